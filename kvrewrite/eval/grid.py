"""The evaluation grid: every method x budget x context of each task, with `full` as the reference.

    cfg = EvalConfig(model="smollm2-135m", tasks=("nll", "needle"), budgets=(0.2, 0.5))
    paths = run_grid(cfg)            # out/eval/smollm2-135m/{nll,needle}.json

What is shared, so that the grid stays affordable on a CPU:
- the model is captured once (torch.export is most of `kvrewrite.apply`'s time) and rewritten once
  per method, at budget 1 (its state then holds a whole prompt); a budget is a runtime target
  (`Method.targets`), so each cell swaps in the method at its budget without a new rewrite (checked:
  the compression ops' options and the state capacities must not depend on the budget, else the
  method is rewritten for that budget);
- each context is tokenized once and prefilled once, by `full`; every method whose prefill graph
  allows it starts from a copy of that exact cache compressed by its own op (kvrewrite/eval/prefill.py),
  which is what its prefill with one chunk holding the whole prompt computes (the paper's setting:
  exact prefill, then compress). `prefill_chunk=N` instead makes every method prefill itself in chunks
  of N (the runtime's streaming mode, compressing while it prefills): one prefill per cell;
- the full reference of a context (its NLL, needle answer, attention outputs) is computed once and
  reused by every method and budget.

`mode="context"` (the needle task only) compresses the haystack alone with each method (rw.prefill_context, in
chunks of the prefill chunk) and runs the question and the answer on that compressed cache
(kvrewrite/context_cache.py), `full` included; nothing is shared between cells then. Its results go to
<task>-context.json, next to the whole-prompt mode's <task>.json.

A task (kvrewrite/eval/{nll,needle,fidelity}.py) builds its contexts and scores one cell; this
module runs the loops, records every cell (skipped ones with the reason) and writes one JSON file
per model and task, rewritten after every cell so that an interrupted run keeps what it measured.
With `resume=True` a rerun with the same task settings keeps every cell that file already holds and
measures only the cells it lacks: a context that holds every method x budget of the run (and the
reference) is copied; one that lacks some cells (an interrupted context, or methods / budgets /
context lengths the earlier run did not select) is prefilled and its reference recomputed, and only
the missing cells run. Cells and contexts of the earlier file outside this run's selection are kept,
and the file's methods, budgets and context lengths become the union. So methods can be added to an
existing result file without rerunning what it holds.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrewrite.methods import METHODS, make_method

logger = logging.getLogger(__name__)
SCHEMA = 1
MODES = ("whole", "context")


@dataclass
class Context:
    """One prompt of a task. Contexts with the same `key` are the same prompt and share one prefill."""

    key: tuple
    input_ids: torch.Tensor  # [1, n_prompt]
    length: int  # the nominal context length (the grid axis)
    coords: dict  # its other grid coordinates, e.g. {"sample": 0} or {"depth": 0.5}
    data: dict = field(default_factory=dict)  # what the task scores against (targets, the answer)


@dataclass(frozen=True)
class EvalConfig:
    """One `kvrewrite eval` run for one model (field help: `kvrewrite eval --help`)."""

    model: str = "smollm2-135m"
    methods: tuple = tuple(METHODS)  # `full` is always run, as the reference
    budgets: tuple = (0.1, 0.2, 0.35, 0.5)
    tasks: tuple = ("nll", "needle", "fidelity")
    context_lengths: tuple = (1024, 2048)
    method_options: dict = field(default_factory=dict)  # {method: {option: value}}
    nll_tokens: int = 256
    samples: int = 1
    depths: tuple = (0.1, 0.5, 0.9)
    answer_tokens: int = 24
    fidelity_steps: int = 16
    prefill_chunk: int | None = None  # None: shared exact prefill; N: every method prefills itself in chunks of N
    mode: str = "whole"  # "whole": the prompt compressed; "context": the context alone, the question after it
    out_dir: str = "out/eval"
    progress: bool = True
    resume: bool = False  # keep the cells a previous run with the same task settings measured; run the rest

    def validate(self) -> None:
        """ValueError naming the setting, with the accepted values."""
        from kvrewrite.eval import TASKS

        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; known methods: {', '.join(METHODS)}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown))}; known tasks: {', '.join(TASKS)}")
        for m in self.method_options:
            if m not in METHODS:
                raise ValueError(f"options given for unknown method {m!r}; known methods: {', '.join(METHODS)}")
        if not self.methods or not self.tasks or not self.context_lengths:
            raise ValueError("give at least one method, one task and one context length")
        bad = [b for b in self.budgets if not 0 < b <= 1]
        if bad or not self.budgets:
            raise ValueError(f"budgets are fractions of the tokens kept, in (0, 1]; got {list(self.budgets)}")
        if any(not isinstance(n, int) or n < 16 for n in self.context_lengths):
            raise ValueError(f"context lengths must be ints >= 16 tokens, got {list(self.context_lengths)}")
        if any(not 0 <= d <= 1 for d in self.depths) or not self.depths:
            raise ValueError(f"needle depths are fractions of the context in [0, 1], got {list(self.depths)}")
        for name in ("nll_tokens", "samples", "answer_tokens", "fidelity_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 2):
            raise ValueError(f"prefill chunk must be an int >= 2 (or unset: shared prefill), "
                             f"got {self.prefill_chunk!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        other = [t for t in self.tasks if self.mode not in getattr(TASKS[t], "modes", ("whole",))]
        if other:
            able = [t for t in TASKS if self.mode in getattr(TASKS[t], "modes", ("whole",))]
            raise ValueError(f"mode {self.mode!r} is for the task(s) {', '.join(able)}; {', '.join(other)} run on the "
                             f"whole prompt (run them in another `kvrewrite eval` with --mode whole)")
        for m in self.methods:  # the options must make a valid method at every budget
            for b in self.budgets if m != "full" else (None,):
                make_method(m, b, **self.method_options.get(m, {}))


# The quick preset: one short context, two budgets, few scored tokens; a smoke test of every task
# and method that finishes in a few minutes on 2 CPU cores. It writes apart from the real results.
QUICK = dict(budgets=(0.2, 0.5), context_lengths=(512,), nll_tokens=32, samples=1, depths=(0.5,), answer_tokens=24,
             fidelity_steps=4, out_dir="out/eval-quick")


def model_slug(name: str) -> str:
    """Directory name of a model's results: the registry name, a folder's name, or org--name for a hub id."""
    p = Path(str(name)).expanduser()
    if p.is_dir():
        return p.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "--", str(name)).strip("-") or "model"


def check_model(name: str) -> None:
    """ValueError for a name that is no registry model, local folder or hub id (before any download)."""
    from kvrewrite.assets import MODELS

    name = str(name)
    if name in MODELS or Path(name).expanduser().is_dir():
        return
    if "/" in name and not name.startswith((".", "/", "~")) and name.count("/") == 1:
        return  # a hub id: from_pretrained resolves it (needs the hub or its local cache)
    raise ValueError(f"unknown model {name!r}: not a registry name, a local Hugging Face folder nor a hub id "
                     f"(org/name); registry models: {', '.join(MODELS)}")


def load_model(name: str):
    """(model, tokenizer) of a registry name, local folder or hub id, in float32 on the CPU."""
    from kvrewrite.assets import load_model as _load

    return _load(name)


def load_text(name: str) -> str:
    from kvrewrite.assets import load_text as _load

    return _load(name)


def environment() -> dict:
    """Versions and machine facts written into every result file."""
    import transformers

    try:
        from importlib.metadata import version

        kv_version = version("kvrewrite")
    except Exception:  # not installed (run from a checkout)
        kv_version = "unknown"
    env = {"kvrewrite": kv_version, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "processor": platform.processor(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "device": "cuda" if torch.cuda.is_available() else "cpu"}
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        if sha.returncode == 0:
            env["git_sha"] = sha.stdout.strip()
            env["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return env


def method_options(method) -> dict:
    """A method's settings as recorded in the JSON: every dataclass field but the budget."""
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method)
            if f.init and f.name != "budget"}


def _compression_calls(rw) -> dict:
    from kvrewrite.eval.prefill import compression_nodes

    nodes = compression_nodes(rw.decode_compress_graph)
    return {n.meta["kvrewrite"]["layer"]: (n.target, dict(n.kwargs)) for n in nodes}


def with_budget(rw, method) -> bool:
    """Swap `method` (same kind, another budget) into `rw` if the rewrite does not depend on the budget:
    same compression op and options per layer, same method state and observation op, and state capacities
    large enough. Returns False if not."""
    if type(method) is not type(rw.method):
        return False
    if hasattr(method, "bind"):
        method.bind(rw.layers)
    calls = _compression_calls(rw)
    for info, cap in zip(rw.layers, rw.capacities):
        if info.window:
            continue
        call = method.compression_call(info)
        if (call is None) != (info.index not in calls):
            return False
        # the method's own state and observation op are part of the rewrite too
        if method.state_fields(info) != rw.method.state_fields(info) or \
                method.observe_call(info) != rw.method.observe_call(info):
            return False
        if call is not None and (call[0], dict(call[1])) != calls[info.index]:
            return False
        if method.capacity(info, rw.max_length, rw.prefill_chunk) > cap:
            return False
    rw.method = method
    return True


class Grid:
    """Runs one EvalConfig on one model; `run()` returns the JSON paths written."""

    def __init__(self, cfg: EvalConfig, model=None, tokenizer=None, text_loader=None):
        cfg.validate()
        self.cfg = cfg
        if model is None:
            check_model(cfg.model)
            model, tokenizer = load_model(cfg.model)
        self.model, self.tok = model, tokenizer
        self.text_loader = text_loader or load_text
        self.slug = model_slug(cfg.model)
        self.out = Path(cfg.out_dir) / self.slug
        self.env = environment()
        self.methods = [m for m in cfg.methods if m != "full"]

    # -- rewritten models ----------------------------------------------------------------------------
    def _build(self, max_length: int) -> None:
        import kvrewrite
        from kvrewrite.capture import capture

        t0 = time.perf_counter()
        chunk = self.cfg.prefill_chunk or 256
        self.captured = capture(self.model, batch_size=1, prefill_chunk=chunk)
        self.rws = {}
        for m in ["full", *self.methods]:
            opts = self.cfg.method_options.get(m, {})
            self.rws[m] = kvrewrite.apply(self.model, m, None if m == "full" else 1.0, max_length=max_length,
                                          captured=self.captured, **opts)
        self.per_budget = {}
        self.build_s = time.perf_counter() - t0
        logger.info("captured once and rewrote %d methods in %.1f s", len(self.rws), self.build_s)

    def rewritten(self, method: str, budget: float):
        """The rewritten model of `method` at `budget` (the budget-1 rewrite when the budget is a runtime target)."""
        import kvrewrite

        m = make_method(method, budget, **self.cfg.method_options.get(method, {}))
        if with_budget(self.rws[method], m):
            return self.rws[method]
        key = (method, budget)
        if key not in self.per_budget:
            logger.info("%s: budget changes the rewrite; rewriting at budget %s", method, budget)
            self.per_budget[key] = kvrewrite.apply(self.model, method, budget, max_length=self.rws["full"].max_length,
                                                   captured=self.captured, **self.cfg.method_options.get(method, {}))
        return self.per_budget[key]

    # -- the loops -----------------------------------------------------------------------------------
    def run(self) -> list:
        from tqdm.auto import tqdm

        from kvrewrite.eval import TASKS
        from kvrewrite.eval.prefill import take_snapshot

        cfg = self.cfg
        tasks = [TASKS[t] for t in cfg.tasks]
        texts, contexts = {}, {}
        for task in tasks:
            if task.text not in texts:
                texts[task.text] = self.text_loader(task.text)
            contexts[task.name] = task.contexts(self.tok, texts[task.text], cfg)
        previous = {t.name: self._previous(t, contexts[t.name]) for t in tasks} if cfg.resume else {}
        self._build(self._max_length(tasks, contexts))
        self.files = {t.name: self._header(t) for t in tasks}
        kept = {}  # (task, context coords): index of its entry in the file's contexts
        for name, (old, _) in previous.items():
            if old is not None:
                earlier = old.get("resumed_from", [])  # the runs that file itself resumed from
                self.files[name]["resumed_from"] = [*(earlier if isinstance(earlier, list) else [earlier]),
                                                    {"started": old["started"], "finished": old.get("finished"),
                                                     "git_sha": old["versions"].get("git_sha"),
                                                     "git_dirty": old["versions"].get("git_dirty")}]
                _union_settings(self.files[name]["settings"], old["settings"])
            # every kept cell is in the file from the start, so that an interrupted run loses none of them;
            # the entry of a context that gets cells added is replaced when it is measured
            for key, (context, runs) in previous[name][1].items():
                kept[name, key] = len(self.files[name]["contexts"])
                self.files[name]["contexts"].append({**context, "resumed": True})
                self.files[name]["runs"].extend(runs)
            self._save(name)

        # by prompt (shortest first): one full prefill, then every task that uses that prompt
        order = sorted(((ctx, task) for task in tasks for ctx in contexts[task.name]),
                       key=lambda x: (x[0].length, str(sorted(x[0].coords.items())), str(x[0].key),
                                      cfg.tasks.index(x[1].name)))
        n_cells = sum(len(contexts[t.name]) * (1 + len(self.methods) * len(cfg.budgets)) for t in tasks)
        bar = tqdm(total=n_cells, desc=f"eval {self.slug}", unit="cell", disable=not cfg.progress)
        snap_key = None
        try:
            for ctx, task in order:
                old, done = previous.get(task.name, (None, {}))
                context, runs = done.get(self._coords(ctx), (None, []))
                if context is not None and context["prompt_tokens"] != int(ctx.input_ids.shape[1]):
                    raise ValueError(f"--resume: {task.name} n={ctx.length} {ctx.coords}: the previous file's prompt "
                                     f"has {context['prompt_tokens']} tokens, {int(ctx.input_ids.shape[1])} now "
                                     f"(text or tokenizer changed); rerun without --resume or use another --out")
                have = {(r["method"], r["budget"]): r for r in runs}
                if context is not None and self._cells(task, old) <= set(have):
                    # every cell of this run was measured by the previous one: kept (in the file already)
                    bar.update(1 + len(self.methods) * len(cfg.budgets))
                    continue
                first = ctx.key != snap_key
                if first:
                    bar.set_postfix_str(f"prefill {ctx.input_ids.shape[1]} tokens")
                    t0 = time.perf_counter()
                    # the context mode shares nothing: each cell compresses the context itself
                    snap = take_snapshot(self.rws["full"], ctx.input_ids) if cfg.mode == "whole" else None
                    snap_key, prefill_s = ctx.key, time.perf_counter() - t0
                entry = {"length": ctx.length, **ctx.coords, "prompt_tokens": int(ctx.input_ids.shape[1]),
                         "full_prefill_s": round(prefill_s, 3), "prefill_counted_here": first}
                if context is not None:  # its kept cells are in the file; the missing ones are measured below
                    entry["resumed_cells"] = len(runs)
                    self.files[task.name]["contexts"][kept[task.name, self._coords(ctx)]] = entry
                else:
                    self.files[task.name]["contexts"].append(entry)
                self._run_context(task, ctx, snap, bar, have=have, entry=entry)
            for task in tasks:
                self.files[task.name]["complete"] = True
                self._save(task.name)
        finally:
            bar.close()
        return [self._path(t.name) for t in tasks]

    @staticmethod
    def _coords(ctx) -> tuple:
        return (ctx.length, *sorted(ctx.coords.items()))

    def _comparable(self, task) -> dict:
        """The settings that must match for a previous file's cells to be reused (methods, budgets and
        context lengths are the selection: they may differ, and each cell is matched on its own)."""
        cfg = self.cfg
        mode = {"mode": cfg.mode} if cfg.mode != "whole" else {}  # files of before the modes have none
        return {"prefill": self._prefill_label(), **mode, "text": task.text, **task.settings(cfg)}

    def _prefill_label(self) -> str:
        cfg = self.cfg
        if cfg.mode == "context":
            return f"context alone, own, chunks of {cfg.prefill_chunk or 256}"
        return "shared" if cfg.prefill_chunk is None else f"own, chunks of {cfg.prefill_chunk}"

    def _path(self, task_name: str) -> Path:
        """out/<model>/<task>.json, or <task>-context.json in the context mode."""
        return self.out / (f"{task_name}-context.json" if self.cfg.mode == "context" else f"{task_name}.json")

    def _cells(self, task, old) -> set:
        """The (method, budget) cells of this run in one context of `task`, the reference included when
        the task records one (as the previous file shows; a task without a file records it)."""
        cells = {(m, b) for m in self.methods for b in self.cfg.budgets}
        if old is None or any(r["method"] == "full" for r in old["runs"]):
            cells.add(("full", 1.0))
        return cells

    def _previous(self, task, contexts):
        """(previous file, {context coords: (context entry, its ok/skipped runs)} of every context it holds),
        or (None, {}) when there is no file; ValueError when its task settings, or the options of a method
        this run measures, differ from this run's."""
        path = self._path(task.name)
        if not path.is_file():
            return None, {}
        old = json.loads(path.read_text())
        want = self._comparable(task)
        have = {k: old.get("settings", {}).get(k) for k in want}
        have = {k: list(v) if isinstance(v, tuple) else v for k, v in have.items()}
        want = json.loads(json.dumps(want, default=_json_default))
        diff = [k for k in want if have[k] != want[k]]
        if old.get("schema") != SCHEMA or old.get("model") != self.cfg.model or diff:
            what = ", ".join(f"{k}: {have[k]} there, {want[k]} now" for k in diff) or "schema or model"
            raise ValueError(f"--resume: {path} was measured with other settings ({what}); "
                             f"rerun without --resume (it replaces the file) or use another --out")
        for r in old["runs"]:  # a method measured again must keep its options, or its cells would mix
            if r["method"] in self.methods and r["budget"] in self.cfg.budgets:
                opts = self.cfg.method_options.get(r["method"], {})
                now = method_options(make_method(r["method"], r["budget"], **opts))
                now = json.loads(json.dumps(now, default=_json_default))
                if r["options"] != now:
                    raise ValueError(f"--resume: {path} measured {r['method']} with options {r['options']}, this run "
                                     f"with {now}; rerun without --resume (it replaces the file) or use another --out")
        names = {k for c in contexts for k in c.coords}
        entries = {(c["length"], *sorted((k, c[k]) for k in names if k in c)): c for c in old["contexts"]}
        done = {key: (c, []) for key, c in entries.items()}
        for r in old["runs"]:
            key = (r["context_length"], *sorted((k, r[k]) for k in names if k in r))
            if key in done and r["status"] in ("ok", "skipped"):
                done[key][1].append(r)
        cells = self._cells(task, old)
        full = sum(cells <= {(r["method"], r["budget"]) for r in runs} for _, runs in done.values())
        logger.info("%s: resuming, %d of its %d contexts hold every cell of this run", path, full, len(done))
        return old, done

    def _max_length(self, tasks, contexts) -> int:
        if self.cfg.mode == "context":  # the slots: the context and the question each padded to whole chunks
            T = self.cfg.prefill_chunk or 256
            need = max(max(-(-c.data["context_ids"].shape[1] // T) * T + -(-c.data["question_ids"].shape[1] // T) * T
                           - (T - 1), c.input_ids.shape[1]) + t.gamma(self.cfg) for t in tasks for c in contexts[t.name])
        else:
            need = max(c.input_ids.shape[1] + t.gamma(self.cfg) for t in tasks for c in contexts[t.name])
        config = self.model.config
        window = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                         "max_position_embeddings", None)
        if window and need > window:
            raise ValueError(f"{self.cfg.model}: the longest prompt plus generated tokens needs {need} positions, "
                             f"beyond the model's window of {window}; use shorter --context-lengths")
        return min(-(-need // 64) * 64, window or need)

    def _run_context(self, task, ctx, snap, bar, have=None, entry=None) -> None:
        """The full reference, then every method x budget, of one task on one prompt; the cells in `have`
        ({(method, budget): run}, kept from a previous run) are not measured again. The reference always
        is (the cells compare against it); if `have` holds it, it is checked against the kept one and
        a difference is written into the context `entry`."""
        cfg, full_rw, have = self.cfg, self.rws["full"], have or {}
        timing = {}
        start = functools.partial(self._start, ctx=ctx, snap=snap, timing=timing)
        bar.set_postfix_str(f"{task.name} n={ctx.length} full")
        t0 = time.perf_counter()
        ref_metrics, ref = task.reference(full_rw, ctx, start, cfg)
        kept = have.get(("full", 1.0))
        if kept is not None and ref_metrics is not None and not _same_metrics(kept["metrics"], ref_metrics):
            logger.warning("%s n=%d %s: the reference differs from the kept one: %s then, %s now", task.name,
                           ctx.length, ctx.coords, kept["metrics"], ref_metrics)
            entry["reference_differs"] = {"kept": kept["metrics"], "now": ref_metrics}
        elif ref_metrics is not None and kept is None:
            self._record(task, ctx, full_rw.method, 1.0, "ok", ref_metrics, timing, time.perf_counter() - t0)
        bar.update(1)
        for method in self.methods:
            for budget in cfg.budgets:
                if (method, budget) in have:
                    bar.update(1)
                    continue
                bar.set_postfix_str(f"{task.name} n={ctx.length} {method}@{budget}")
                rw = self.rewritten(method, budget)
                timing.clear()
                t0 = time.perf_counter()
                try:
                    if cfg.mode == "context":  # the context is compressed alone, to budget x its tokens
                        rw.method.check_generation(int(ctx.data["context_ids"].shape[1]), 0)
                    else:
                        rw.method.check_generation(int(ctx.input_ids.shape[1]), task.gamma(cfg))
                except ValueError as e:  # the method's settings cannot run at this budget: recorded, not fatal
                    self._record(task, ctx, rw.method, budget, "skipped", {}, timing, 0.0, reason=str(e))
                else:
                    metrics = task.run(rw, ctx, start, ref, cfg)
                    self._record(task, ctx, rw.method, budget, "ok", metrics, timing, time.perf_counter() - t0)
                bar.update(1)

    def _start(self, rw, gamma: int, *, ctx, snap, timing) -> torch.Tensor:
        """What a task calls to begin a cell: load the shared prefill (or prefill) for `gamma` tokens to
        come; returns the last prompt position's logits [1, V] and notes the time and slots kept."""
        from kvrewrite.eval.prefill import load_snapshot, shares_prefill

        t = time.perf_counter()
        if self.cfg.mode == "context":
            state = rw.prefill_context(ctx.data["context_ids"])
            logits, _ = rw._start_from_context(ctx.data["question_ids"], None, gamma, state)
            timing["start"] = "context"
        # `full` always restarts from its own snapshot (exact in any chunking); a method does when sharing is on
        elif rw is self.rws["full"] or (self.cfg.prefill_chunk is None and shares_prefill(rw)[0]):
            logits, timing["start"] = load_snapshot(rw, snap, gamma), "shared"
        else:
            logits, timing["start"] = rw.prefill(ctx.input_ids, max_new_tokens=gamma), "own"
        timing["start_s"] = time.perf_counter() - t
        full_layers = [i.index for i in rw.layers if not i.window]
        timing["kv_slots"] = sum(int(rw.layer_state(i)["fill"].max()) for i in full_layers) / max(len(full_layers), 1)
        return logits

    # -- results -------------------------------------------------------------------------------------
    def _header(self, task) -> dict:
        cfg, text_cfg = self.cfg, self.model.config
        text_cfg = text_cfg.get_text_config() if hasattr(text_cfg, "get_text_config") else text_cfg
        return {
            "schema": SCHEMA,
            "task": task.name,
            "model": cfg.model,
            "model_info": {"model_type": text_cfg.model_type, "num_layers": text_cfg.num_hidden_layers,
                           "window": getattr(text_cfg, "max_position_embeddings", None),
                           "sliding_layers": sum(1 for i in self.rws["full"].layers if i.window)},
            "settings": {"methods": ["full", *self.methods], "budgets": list(cfg.budgets),
                         "context_lengths": list(cfg.context_lengths),
                         "prefill": self._prefill_label(), "mode": cfg.mode,
                         "max_length": self.rws["full"].max_length, "build_s": round(self.build_s, 2),
                         "text": task.text, **task.settings(cfg)},
            "versions": self.env,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "complete": False,
            "contexts": [],
            "runs": [],
        }

    def _record(self, task, ctx, method, budget, status, metrics, timing, seconds, reason=None) -> None:
        run = {"model": self.cfg.model, "task": task.name, "method": method.name, "options": method_options(method),
               "budget": budget, "context_length": ctx.length, **ctx.coords,
               "prompt_tokens": int(ctx.input_ids.shape[1]), "status": status, "metrics": metrics,
               "kv_slots": timing.get("kv_slots"), "prefill": timing.get("start"),
               "start_s": round(timing["start_s"], 3) if "start_s" in timing else None, "seconds": round(seconds, 3)}
        if reason:
            run["reason"] = reason
        self.files[task.name]["runs"].append(run)
        self._save(task.name)

    def _save(self, task_name: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = self.files[task_name]
        data["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        path = self._path(task_name)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
        tmp.replace(path)


def _union_settings(settings: dict, old: dict) -> None:
    """A resumed file's selection: its methods, budgets and context lengths and those of the previous file."""
    before = old.get("methods", [])
    settings["methods"] = [*before, *(m for m in settings["methods"] if m not in before)]
    for key in ("budgets", "context_lengths"):
        settings[key] = sorted({*old.get(key, []), *settings[key]})


def _same_metrics(a: dict, b: dict, rel: float = 1e-4) -> bool:
    """Equal metric dicts, numbers to a relative `rel` (a recomputed reference vs the kept one)."""
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if abs(x - y) > rel * max(1.0, abs(x), abs(y)):
                return False
        elif x != y:
            return False
    return True


def _json_default(x):
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def run_grid(cfg: EvalConfig, model=None, tokenizer=None, text_loader=None) -> list:
    """Run `cfg`; returns the JSON files written (out_dir/<model>/<task>.json). `model`/`tokenizer`
    skip loading cfg.model (tests pass tiny models); `text_loader(name)` replaces kvrewrite.assets.load_text."""
    return Grid(cfg, model, tokenizer, text_loader).run()
