"""JSON -> plots -> results page. Runs nothing: `kvrewrite eval --report-only` redraws from out/eval.

    write_report("out/eval", "docs/results.md")   # plots go to docs/results/<model>-*.png

Per model: quality vs budget (one line per method and context length, the full cache as the
reference), needle heatmaps (depth x length, one panel per method and budget) and per-layer
attention error; tables of every metric. Everything on the page comes from the JSON files, so the
page is regenerated, never edited by hand; hand-written findings live in <page>-notes.md
(docs/results-notes.md), which the page includes.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)
TASK_ORDER = ("nll", "needle", "needle-context", "fidelity")  # needle-context: the needle task in mode "context"


def load_results(out_dir) -> dict:
    """{model slug: {task: result file dict}} of every out_dir/<model>/<task>.json; a file of the context mode
    (settings "mode": "context") under "<task>-context"."""
    results = defaultdict(dict)
    for path in sorted(Path(out_dir).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            logger.warning("skipping %s: %s", path, e)
            continue
        if data.get("schema") != 1 or "task" not in data:
            continue
        mode = data.get("settings", {}).get("mode", "whole")
        results[path.parent.name][data["task"] + ("" if mode == "whole" else f"-{mode}")] = data
    return dict(results)


def _ok(runs):
    return [r for r in runs if r["status"] == "ok"]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _rows(data):
    """Table rows in order: full first, then each method by budget: [(method, budget)]."""
    methods = data["settings"]["methods"]
    keys = {(r["method"], r["budget"]) for r in data["runs"]}
    return sorted(keys, key=lambda k: (methods.index(k[0]) if k[0] in methods else 99, k[1]))


def _cell(data, method, budget, length, metric):
    """Mean of `metric` over the ok runs of one (method, budget, length); None if none; 'skip' if all skipped."""
    runs = [r for r in data["runs"]
            if r["method"] == method and r["budget"] == budget and r["context_length"] == length]
    if runs and not _ok(runs):
        return "skip"
    return _mean([r["metrics"].get(metric) for r in _ok(runs)])


def _fmt(x, spec=".3f", signed=False):
    if x is None:
        return ""
    if x == "skip":
        return "skipped¹"
    return format(x, ("+" if signed else "") + spec)


# -- plots -------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(methods):
    plt = _plt()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}


SPREAD_FOR_LOG = 50  # a panel whose largest |value| is this many times its median |value| gets a symlog y axis


def _spread(ax) -> float:
    """max |y| / median |y| over the panel's plotted points (0 when there are none)."""
    ys = sorted(abs(float(y)) for line in ax.get_lines() for y in line.get_ydata())
    ys = [y for y in ys if y > 0]
    return ys[-1] / ys[len(ys) // 2] if ys else 0.0


def plot_budget(model, tasks: dict, path: Path) -> Path | None:
    """Quality vs budget: one panel per metric, one color per method, one line style per context length."""
    plt = _plt()
    panels = []
    if "nll" in tasks:
        panels.append(("nll", "nll_delta", "NLL − NLL(full), nats/token (lower is better)", 0.0))
    if "needle" in tasks:
        panels.append(("needle", "correct", "needle accuracy (exact match)", None))
    if "fidelity" in tasks:
        panels.append(("fidelity", "attn_rel_err", "attention rel. error vs full (same query)", 0.0))
        panels.append(("fidelity", "topk_recall", "top-k recall (k = slots kept)", 1.0))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.2), squeeze=False)
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]
    for ax, (task, metric, label, ideal) in zip(axes[0], panels):
        data = tasks[task]
        methods = [m for m in data["settings"]["methods"] if m != "full"]
        colors = _colors(data["settings"]["methods"])
        lengths = sorted({r["context_length"] for r in data["runs"]})
        for li, n in enumerate(lengths):
            for m in methods:
                budgets = sorted({r["budget"] for r in data["runs"] if r["method"] == m})
                pts = [(b, _cell(data, m, b, n, metric)) for b in budgets]
                pts = [(b, y) for b, y in pts if isinstance(y, float | int)]
                if pts:
                    ax.plot(*zip(*pts), styles[li % 4], marker=markers[li % 4], color=colors[m], ms=4,
                            label=f"{m}, n={n}")
            full = _cell(data, "full", 1.0, n, metric)
            if task == "needle" and isinstance(full, float | int):
                ax.axhline(full, color="k", ls=styles[li % 4], lw=0.8, label=f"full, n={n}")
        if ideal is not None:
            ax.axhline(ideal, color="k", lw=0.8, alpha=0.5)
        ax.set_xlabel("budget (fraction of tokens kept)")
        if task != "needle" and _spread(ax) > SPREAD_FOR_LOG:  # one method far off would flatten the others
            ax.set_yscale("symlog", linthresh=0.05 if metric == "nll_delta" else 0.1)
            if metric != "nll_delta":  # errors and recalls are >= 0
                ax.set_ylim(bottom=0)
            label += " (symlog)"
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        if task == "needle":
            ax.set_ylim(-0.05, 1.05)
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    rows = -(-len(legend) // 6)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 6), fontsize=7, frameon=False)
    fig.suptitle(f"{model}: quality vs KV budget", fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_needle(model, data, path: Path) -> Path | None:
    """Heatmaps depth x length of needle accuracy: rows are methods, columns full + each budget."""
    import numpy as np

    plt = _plt()
    runs = _ok(data["runs"])
    if not runs:
        return None
    methods = [m for m in data["settings"]["methods"] if m != "full"] or ["full"]
    budgets = sorted({r["budget"] for r in runs if r["method"] != "full"})
    lengths = sorted({r["context_length"] for r in runs})
    depths = sorted({r["depth"] for r in runs})
    cols = [("full", 1.0)] + [(None, b) for b in budgets]
    size = (1.0 + (0.55 * len(lengths) + 0.6) * len(cols), 0.9 + (0.35 * len(depths) + 0.5) * len(methods))
    fig, axes = plt.subplots(len(methods), len(cols), figsize=size, squeeze=False)
    for i, m in enumerate(methods):
        for j, (cm, b) in enumerate(cols):
            method = cm or m
            grid = np.full((len(depths), len(lengths)), np.nan)
            for r in data["runs"]:
                if r["method"] == method and r["budget"] == b and r["status"] == "ok":
                    grid[depths.index(r["depth"]), lengths.index(r["context_length"])] = r["metrics"]["correct"]
            ax = axes[i][j]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for (y, x), v in np.ndenumerate(grid):
                ax.text(x, y, "–" if np.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_title("full" if cm else f"{m} @ {b:g}", fontsize=8)
            if j == 0:
                ax.set_ylabel("depth", fontsize=7)
            if i == len(methods) - 1:
                ax.set_xlabel("context tokens", fontsize=7)
    fig.suptitle(f"{model}: needle found (1) or not (0); – not run or skipped", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(model, data, path: Path) -> Path | None:
    """Per-layer attention error (same query) at the longest context: one panel per method, one line per budget."""
    plt = _plt()
    runs = _ok(data["runs"])
    if not runs:
        return None
    n = max(r["context_length"] for r in runs)
    methods = [m for m in data["settings"]["methods"] if m != "full"]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.4 * len(methods), 3.4), squeeze=False, sharey=True)
    colors = _colors(sorted({r["budget"] for r in runs}))  # one color per budget in every panel
    for ax, m in zip(axes[0], methods):
        for b in sorted({r["budget"] for r in runs if r["method"] == m}):
            sel = [r["metrics"]["per_layer"]["attn_rel_err"] for r in runs
                   if r["method"] == m and r["budget"] == b and r["context_length"] == n]
            if sel:
                per = [_mean(vals) for vals in zip(*sel)]
                ax.plot(range(len(per)), per, marker=".", color=colors[b], label=f"budget {b:g}")
        ax.set_title(f"{m}, n={n}", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
        else:  # the method has no cell at this length (e.g. a resumed run that added it at shorter ones)
            ax.text(0.5, 0.5, f"not run at n={n}", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    axes[0][0].set_ylabel("attention rel. error (same query)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- page --------------------------------------------------------------------------------------------

INTRO = """\
# Quality results

Generated by `kvrewrite eval` (kvrewrite/eval/) from the JSON files in `{out_dir}`; regenerate the
page and its plots with `{regen}`. This page is overwritten: edit
kvrewrite/eval/report.py instead.

**Tasks.**
- `nll`: continuation NLL (nats/token) of a fixed Shakespeare passage (Project Gutenberg;
  `nll_tokens` long, one per sample) after the n tokens before it, scored teacher-forced with the
  compressed cache (decode-time re-compression included). Δ = method − full on the same passage.
- `needle`: a passphrase sentence hidden at a depth of n tokens of Paul Graham essays, the question
  after the context (in the chat template), greedy answer of at most `answer_tokens` tokens, exact
  match of the passphrase as a word.
- `fidelity`: per layer, on the first `fidelity_steps` decode queries of the nll passage, the
  relative error ‖o − o_full‖ / ‖o_full‖ of the attention output for the **same** query against both
  caches (it isolates the layer's cache; *e2e*: each model's own query and output, errors of earlier
  layers and steps included), and ClusterKV's top-k recall (arXiv 2412.03213): k = the slots the
  compressed cache holds for the query's KV head; the share of the k tokens with the largest true
  attention weight (over the full cache) that the compressed cache still holds. A merged slot holds
  only its anchor token (the latest it absorbed, its `slot_pos`), so for merging methods the recall is
  a lower bound of what the cache represents; *verbatim* counts only slots of degree 1. Means over
  compressed layers, query heads and steps.

**Budget.** As everywhere in kvrewrite: B = round(budget · (n + Γ)) slots per KV head, Γ the tokens
that follow the prompt (`nll_tokens`, `answer_tokens` or `fidelity_steps`); a row is compressed
back to B when it reaches B + 32. A cell is *skipped* (¹) when the method cannot run at that budget
(e.g. Chelsea's 16 sink + 64 recent slots need B ≥ 82).

**Shared prefill (decision).** A method compresses inside its own prefill graph, so nothing can be
shared *during* a method's streaming prefill. What the grid shares instead: the model is captured
once and rewritten once per method (at budget 1; a budget is a runtime target, swapped per cell);
each context is tokenized and prefilled once, by `full`; every method then starts from a copy of that
exact cache, compressed by the method's own prefill compression op (read from its rewritten graph).
That is exactly what the method's prefill computes when one chunk holds the whole prompt: the papers'
setting, exact prefill and then compression (tests/test_eval.py checks the equality on state and
decode logits). The full reference (NLL, answer, attention outputs) is computed once per context and
reused by every method and budget. A method whose prefill graph holds more than append, attend and
compress (e.g. scores of the prefill queries) prefills itself. The cost of the decision: the numbers
here are for one-shot compression after an exact prefill, not for kvrewrite's default streaming
prefill (chunks of 256 that attend to the already compressed past, which keeps memory at B + g +
chunk slots); `kvrewrite eval --prefill-chunk 256` measures that mode, at one prefill per cell.
"""


def _cost(tasks: dict) -> str:
    """What sharing the prefill saved, from the recorded timings."""
    prefill = shared_starts = own = cells = 0.0
    for data in tasks.values():
        prefill += sum(c["full_prefill_s"] for c in data["contexts"] if c.get("prefill_counted_here"))
        by_ctx = {}
        for c in data["contexts"]:
            by_ctx[(c["length"], c.get("sample"), c.get("depth"))] = c["full_prefill_s"]
        for r in _ok(data["runs"]):
            if r["method"] == "full" or r.get("start_s") is None:
                continue
            if r.get("prefill") == "shared":  # a method that prefills itself (h2o, snapkv) shares nothing
                cells += 1
                shared_starts += r["start_s"]
                own += by_ctx.get((r["context_length"], r.get("sample"), r.get("depth")), 0.0) + r["start_s"]
    if not cells or not shared_starts:
        return ""
    return (f"Cost here: {prefill:.0f} s of full prefills (once per prompt), {shared_starts:.0f} s of compressions "
            f"to start {cells:.0f} method cells from them; prefilling each cell instead would have taken about "
            f"{own:.0f} s (a one-chunk prefill = the full prefill + the same compression).")


def _reductions(data) -> list:
    """How this run is smaller than the standard grid (EvalConfig's defaults), for the page to say so."""
    from kvrewrite.eval.grid import EvalConfig

    s, d, out = data["settings"], EvalConfig(), []
    missing = [m for m in d.methods if m not in s["methods"]]
    if missing:
        out.append(f"methods {', '.join(missing)} not run")
    if set(d.budgets) - set(s["budgets"]):
        out.append(f"budgets {', '.join(f'{b:g}' for b in s['budgets'])} only")
    for key in ("nll_tokens", "answer_tokens", "fidelity_steps", "samples"):
        if key in s and s[key] < getattr(d, key):
            out.append(f"{key} {s[key]} (standard {getattr(d, key)})")
    if "depths" in s and len(s["depths"]) < len(d.depths):
        out.append(f"depths {', '.join(f'{x:g}' for x in s['depths'])} only")
    return out


CONTEXT_MODE = ("**Context mode** (`--mode context`): the haystack alone is compressed by each method "
                "(`rw.prefill_context`, B = round(budget · context tokens)), then the question and the answer run on "
                "that cache, the method's re-compression every 32 tokens included (docs/context.md); `full` too.")


def _settings_line(data):
    s = data["settings"]
    v = data["versions"]
    sha = (v.get("git_sha") or "")[:10] + ("+dirty" if v.get("git_dirty") else "")
    extra = {k: s[k] for k in ("nll_tokens", "samples", "depths", "answer_tokens", "fidelity_steps") if k in s}
    return (f"methods {', '.join(s['methods'])}; budgets {', '.join(f'{b:g}' for b in s['budgets'])}; context lengths "
            f"{', '.join(map(str, s['context_lengths']))}; prefill {s['prefill']}; "
            + (f"mode {s['mode']}; " if s.get("mode", "whole") != "whole" else "")
            + ", ".join(f"{k} {v}" for k, v in extra.items())
            + f". torch {v['torch']}, transformers {v['transformers']}, {v['device']} "
            f"({v.get('torch_threads')} threads), "
            f"kvrewrite {sha}; {data['started']} → {data.get('finished', '?')}"
            + _resumed(data)
            + ("" if data.get("complete") else " **(incomplete run)**"))


def _resumed(data) -> str:
    """Where `--resume` copied contexts from (the earlier runs' start and commit)."""
    earlier = data.get("resumed_from") or []
    earlier = earlier if isinstance(earlier, list) else [earlier]
    resumed = sum(1 for c in data["contexts"] if c.get("resumed"))
    extended = sum(1 for c in data["contexts"] if c.get("resumed_cells"))
    if not earlier or not (resumed or extended):
        return ""
    runs = ", ".join(f"{r['started']} ({(r.get('git_sha') or '')[:10]}{'+dirty' if r.get('git_dirty') else ''})"
                     for r in earlier)
    what = [f"{resumed} context(s) resumed"] if resumed else []
    if extended:
        what.append(f"{extended} context(s) extended (their cells kept, the missing ones measured here)")
    return f"; {' and '.join(what)} from earlier runs: {runs}"


def _table(data, metric_fmt, lengths, title_fmt="n={}"):
    head = "| method | budget | " + " | ".join(title_fmt.format(n) for n in lengths) + " |"
    lines = [head, "|---|---|" + "---|" * len(lengths)]
    for m, b in _rows(data):
        cells = [metric_fmt(data, m, b, n) for n in lengths]
        lines.append(f"| {m} | {b:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _nll_cell(data, m, b, n):
    v, d = _cell(data, m, b, n, "nll"), _cell(data, m, b, n, "nll_delta")
    if v == "skip":
        return _fmt(v)
    if v is None:
        return ""
    return f"{v:.3f}" + ("" if d is None else f" ({d:+.3f})")


def _needle_cell(data, m, b, n):
    runs = [r for r in data["runs"] if r["method"] == m and r["budget"] == b and r["context_length"] == n]
    if runs and not _ok(runs):
        return _fmt("skip")
    ok = _ok(runs)
    return f"{sum(r['metrics']['correct'] for r in ok)}/{len(ok)}" if ok else ""


def _fid_cell(a, b_, spec=".3f"):
    def f(data, m, b, n):
        x, y = _cell(data, m, b, n, a), _cell(data, m, b, n, b_)
        if x == "skip":
            return _fmt(x)
        return "" if x is None else f"{x:{spec}} / {y:{spec}}"
    return f


def _skipped(tasks):
    seen = {}
    for data in tasks.values():
        for r in data["runs"]:
            if r["status"] == "skipped":
                where = f"{data['task']} n={r['context_length']}"
                seen.setdefault((r["method"], r["budget"], r["reason"]), []).append(where)
    return [f"- ¹ {m} @ {b:g} ({', '.join(sorted(set(where)))}): {reason}" for (m, b, reason), where in seen.items()]


def _answers(data, limit=12):
    """A few needle answers of the compressed methods, to show how they fail."""
    rows = [r for r in _ok(data["runs"]) if not r["metrics"]["correct"]][:limit]
    if not rows:
        return ""
    out = ["<details><summary>wrong needle answers (first {})</summary>\n".format(len(rows)),
           "| method | budget | n | depth | answer |", "|---|---|---|---|---|"]
    for r in rows:
        ans = r["metrics"]["answer"].replace("|", "\\|").replace("\n", " ")[:80]
        out.append(f"| {r['method']} | {r['budget']:g} | {r['context_length']} | {r['depth']:g} | `{ans}` |")
    out.append("\n</details>")
    return "\n".join(out)


def _image(alt, png: Path, page: Path) -> str:
    return f"![{alt}]({png.relative_to(page.parent).as_posix()})\n"


def write_report(out_dir, docs_path) -> Path:
    """Write the plots (next to docs_path, in <stem>/) and the page; returns the page's path."""
    out_dir, docs_path = Path(out_dir), Path(docs_path)
    results = load_results(out_dir)
    if not results:
        raise ValueError(f"no results in {out_dir}/<model>/<task>.json: run `kvrewrite eval` first")
    plots_dir = docs_path.parent / docs_path.stem
    if importlib.util.find_spec("matplotlib") is None:  # optional: pip install 'kvrewrite[plot]'
        logger.warning("matplotlib is not installed (pip install 'kvrewrite[plot]'): writing the page without plots")
        plots_dir = None
    else:
        plots_dir.mkdir(parents=True, exist_ok=True)
    try:
        shown_out = out_dir.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown_out = out_dir
    regen = "kvrewrite eval --report-only"
    if Path(shown_out) != Path("out/eval"):
        regen += f" --out {shown_out}"
    try:
        shown_docs = docs_path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown_docs = docs_path
    if Path(shown_docs) != Path("docs/results.md"):
        regen += f" --docs {shown_docs}"
    page = [INTRO.format(out_dir=f"{shown_out}/<model>/<task>.json", regen=regen)]
    notes = docs_path.with_name(f"{docs_path.stem}-notes.md")  # hand-written findings, kept across regenerations
    if notes.is_file():
        page.append(f"## Findings\n\n*(hand-written in {notes.name}, not generated)*\n\n{notes.read_text().strip()}\n")
    for slug, tasks in sorted(results.items()):
        tasks = {t: tasks[t] for t in TASK_ORDER if t in tasks}
        any_data = next(iter(tasks.values()))
        info = any_data["model_info"]
        page.append(f"## {any_data['model']}\n")
        page.append(f"{info['model_type']}, {info['num_layers']} layers"
                    + (f" ({info['sliding_layers']} sliding-window, kept exact)" if info.get("sliding_layers") else "")
                    + f", window {info['window']}.\n")
        cost = _cost(tasks)
        if cost:
            page.append(cost + "\n")
        budget_png = plots_dir and plot_budget(any_data["model"], tasks, plots_dir / f"{slug}-budget.png")
        if budget_png:
            page.append(_image(f"quality vs budget, {slug}", budget_png, docs_path))
        for task, data in tasks.items():
            lengths = sorted({r["context_length"] for r in data["runs"]})
            page.append(f"### {task}\n\n{_settings_line(data)}\n")
            if task.endswith("-context"):
                page.append(CONTEXT_MODE + "\n")
            kind = data["task"]
            reduced = _reductions(data)
            if reduced:
                page.append(f"**Reduced grid** (CPU time): {'; '.join(reduced)}.\n")
            if kind == "nll":
                page.append("NLL in nats/token (Δ vs full on the same passage; lower is better):\n")
                page.append(_table(data, _nll_cell, lengths) + "\n")
            elif kind == "needle":
                page.append("Needles found (exact match) over the depths:\n")
                page.append(_table(data, _needle_cell, lengths) + "\n")
                png = plots_dir and plot_needle(data["model"], data, plots_dir / f"{slug}-{task}.png")
                if png:
                    page.append(_image(f"needle heatmaps, {slug}", png, docs_path))
                answers = _answers(data)
                if answers:
                    page.append(answers + "\n")
            elif kind == "fidelity":
                page.append("Attention relative error vs full, same query / end-to-end (lower is better):\n")
                page.append(_table(data, _fid_cell("attn_rel_err", "attn_rel_err_e2e"), lengths) + "\n")
                page.append("Top-k recall, anchor / verbatim (higher is better):\n")
                page.append(_table(data, _fid_cell("topk_recall", "topk_recall_exact", ".2f"), lengths) + "\n")
                png = plots_dir and plot_layers(data["model"], data, plots_dir / f"{slug}-layers.png")
                if png:
                    page.append(_image(f"per-layer attention error, {slug}", png, docs_path))
        skipped = _skipped(tasks)
        if skipped:
            page.append("\n".join(skipped) + "\n")
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text("\n".join(page).rstrip() + "\n")
    return docs_path
