"""`kvrewrite` command line. `kvrewrite run` is the main job: a real model, a long prompt, the full
cache against a compressed one, answers, KV memory and time side by side. `kvrewrite check MODEL_DIR`
verifies the rewrite of a local model folder against HF (kvrewrite/verification.py)."""
import argparse
import logging
import sys
import time

import torch

NEEDLE = "The secret passphrase for the archive is 'amber-falcon-42'."
QUESTION = "What is the secret passphrase for the archive? Answer with the passphrase only."


def _long_document(tokenizer, context_tokens: int) -> str:
    """Paul Graham essays cut to about `context_tokens` tokens, with a needle hidden in the middle."""
    from kvrewrite.assets import load_text

    text = load_text("paul_graham")
    ids = tokenizer(text[: context_tokens * 8], add_special_tokens=False)["input_ids"][:context_tokens]
    half = tokenizer.decode(ids[: len(ids) // 2]), tokenizer.decode(ids[len(ids) // 2 :])
    return f"{half[0]}\n{NEEDLE}\n{half[1]}"


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def _hf_static_row(model, tok, ids, max_new_tokens, dense):
    """What a user would otherwise run: HF generate with a StaticCache, greedy, on the whole prompt (the context
    and the first question)."""
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=tok.pad_token_id)
    n = ids.shape[1]
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, **kw)
        t_total = time.perf_counter() - t0
    new = out[0, n:]
    answer = tok.decode(new, skip_special_tokens=True).strip()
    print(f"[hf-static] {answer!r}\n", flush=True)
    tps = (len(new) - 1) / max(t_total - t_prefill, 1e-9)
    return ("hf-static", [answer], {"kvrewrite": dense, "dense": dense}, model.config.num_hidden_layers * n,
            0.0, t_prefill, tps)


def cmd_run(args) -> int:
    """The main job through kvrewrite.pipeline: the document compressed once per method, then every question
    answered on a copy of it (the HF baseline runs the whole prompt of the first question)."""
    import kvrewrite
    from kvrewrite.assets import load_model
    from kvrewrite.text_pipeline import PromptFormat

    torch.manual_seed(0)
    print(f"loading {args.model} ...", flush=True)
    model, tok = load_model(args.model)
    context = _long_document(tok, args.context_tokens)
    questions = args.question or [QUESTION]
    fmt = PromptFormat(tok, bool(getattr(tok, "chat_template", None)))
    encoded = [fmt.encode(q, context) for q in questions]
    n_ctx, n_q = len(encoded[0][0]), max(len(q) for _, q in encoded)
    # the document and the question are each left-padded to whole prefill chunks (docs/context.md, "Sizes"): room
    # for the second padding too, which `full` keeps
    max_length = n_ctx + n_q + args.max_new_tokens + args.prefill_chunk - 1
    print(f"context: {n_ctx} tokens (a passphrase in the middle), compressed once per method; {len(questions)} "
          f"question(s) of up to {n_q} tokens; up to {args.max_new_tokens} new tokens each\n", flush=True)
    rows = []
    for method in ["full", args.method] if args.method != "full" else ["full"]:
        opts = {} if method == "full" else {"budget": args.budget}
        t0 = time.perf_counter()
        pipe = kvrewrite.pipeline(model, method, tokenizer=tok, max_length=max_length,
                                  prefill_chunk=args.prefill_chunk, **opts)
        t_apply = time.perf_counter() - t0
        # greedy, as the hf-static row (a model's generation_config may ask for sampling; rw.generate follows it)
        answers = pipe(questions, context=context, max_new_tokens=args.max_new_tokens, do_sample=False, progress=True)
        t = pipe.last_timings
        mem = pipe.rw.cache_bytes(seq_len=max_length)
        rows.append((method, answers, mem, pipe.last_context.slots() * len(pipe.rw.layers), t_apply, t["context_s"],
                     t["new_tokens"] / max(t["decode_s"], 1e-9)))
        label = method if method == "full" else f"{method} budget={args.budget}"
        for q, a in zip(questions, answers):
            print(f"[{label}] {q}\n  -> {a!r}\n", flush=True)
    if args.hf_baseline:
        ctx, q = encoded[0]
        rows.insert(0, _hf_static_row(model, tok, torch.tensor([ctx + q]), args.max_new_tokens, rows[0][2]["dense"]))
    dense = rows[0][2]["dense"]
    print(f"{'method':<14}{'KV state':>12}{'vs dense':>10}{'context slots':>15}{'capture s':>11}{'context s':>11}"
          f"{'decode tok/s':>14}")
    for method, _, mem, used, t_apply, t_context, tps in rows:
        print(f"{method:<14}{_human(mem['kvrewrite']):>12}{mem['kvrewrite'] / dense:>9.0%} {used:>14}"
              f"{t_apply:>11.1f}{t_context:>11.1f}{tps:>14.1f}")
    print(f"(dense HF static cache for {max_length} tokens: {_human(dense)}; kvrewrite's state is as allocated, "
          f"including the prefill chunk and g headroom; 'context slots': the compressed document, summed over layers "
          f"(hf-static: the whole prompt); 'context s': compressing the document (hf-static: the prompt's prefill); "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__})")
    if not args.question:
        print("passphrase found: " + ", ".join(f"{r[0]}={'amber-falcon-42' in r[1][0]}" for r in rows))
    return 0


def _csv(kind):
    """argparse type: a comma-separated list of `kind` (repeatable flags are joined by the caller)."""

    def parse(text):
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, "
                                             f"got {text!r}") from None

    return parse


def _option(text):
    """--option METHOD.NAME=VALUE -> (method, name, value); the value is read as a Python literal if it is one."""
    import ast

    head, sep, value = text.partition("=")
    method, dot, name = head.partition(".")
    if not (sep and dot and method and name):
        raise argparse.ArgumentTypeError(f"expected METHOD.OPTION=VALUE (e.g. chelsea.n_recent=32), got {text!r}")
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass  # a plain string
    return method.strip(), name.strip(), value


def cmd_eval(args) -> int:
    from kvrewrite.eval import QUICK, EvalConfig, run_grid
    from kvrewrite.eval.grid import check_model
    from kvrewrite.eval.report import write_report

    flat = lambda xs: [x for group in xs for x in group] if xs else None  # noqa: E731
    models = flat(args.model) or ["smollm2-135m"]
    fields = {"methods": flat(args.methods), "budgets": flat(args.budgets), "tasks": flat(args.task),
              "context_lengths": flat(args.context_lengths), "depths": flat(args.depths), "nll_tokens": args.nll_tokens,
              "samples": args.samples, "answer_tokens": args.answer_tokens, "fidelity_steps": args.fidelity_steps,
              "prefill_chunk": args.prefill_chunk, "mode": args.mode, "out_dir": args.out,
              "resume": args.resume or None}
    base = dict(QUICK) if args.quick else {}
    base.update({k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if v is not None})
    if args.mode == "context" and not args.task:  # the one task of that mode
        base["tasks"] = ("needle",)
    options = {}
    for method, name, value in args.option or []:
        options.setdefault(method, {})[name] = value
    out_dir = base.get("out_dir", EvalConfig.out_dir)
    docs = args.docs or (f"{out_dir}/results.md" if args.quick else "docs/results.md")
    if not args.report_only:
        configs = [EvalConfig(model=m, method_options=options, progress=not args.no_progress, **base) for m in models]
        for cfg in configs:  # every setting and model name is checked before the first model loads
            cfg.validate()
            check_model(cfg.model)
        for cfg in configs:
            t0 = time.perf_counter()
            paths = run_grid(cfg)
            print(f"{cfg.model}: wrote {', '.join(map(str, paths))} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.report:
        page = write_report(out_dir, docs)
        print(f"wrote {page} (plots next to it)", flush=True)
    return 0


def cmd_bench(args) -> int:
    from kvrewrite.bench.e2e import cmd_bench as run

    return run(args)


def _model_for_check(path: str, config_only: bool, dtype: torch.dtype, attn: str | None):
    """(model, copy): the folder's model with its weights (copy False), or, with --config-only or without
    weights, its config on the meta device (copy True: verify builds a reduced random-weight copy).
    ValueError (exit 2) unless the folder holds a Hugging Face causal LM."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; expected a local Hugging Face model folder (save_pretrained)")
    kwargs = {"dtype": dtype, **({"attn_implementation": attn} if attn else {})}
    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as e:  # an unknown model type, a config of a model that is not a causal LM
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        raise ValueError(f"{path}: not a loadable causal LM ({why})") from None
    weights = [f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in folder.glob(pattern)]
    if config_only or not weights:
        return skeleton, True
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except Exception as e:
        raise ValueError(f"{path}: the weights do not load ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
                         f"--config-only checks a random-weight copy of the config") from None
    return model.eval(), False


def cmd_check(args) -> int:
    import kvrewrite
    from kvrewrite.errors import RewriteError

    dtype = getattr(torch, args.dtype)
    model, copy = _model_for_check(args.model_dir, args.config_only, dtype, args.attn)
    print(f"checking {args.model_dir}: {model.config.model_type}, "
          f"{'a reduced random-weight copy of its config' if copy else 'its weights'}, {args.dtype}", flush=True)
    try:
        report = kvrewrite.verify(model, copy=copy, max_length=args.max_length, prompt_tokens=args.prompt_tokens,
                                  new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk, atol=args.atol,
                                  progress=not args.no_progress)
    except RewriteError as e:  # capture or the passes refuse the model: it cannot be rewritten, a failed check
        print(f"kvrewrite check: FAIL: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0 if report.ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvrewrite", description="Compress the KV cache of Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: full vs compressed cache on a real model and a long prompt")
    run.add_argument("--model", default="smollm2-135m", help="registry name (smollm2-135m, qwen2.5-0.5b, gemma3-270m), local HF folder or hub id")
    run.add_argument("--method", default="chelsea", help="compression method to compare with full (default: chelsea)")
    run.add_argument("--budget", type=float, default=0.5, help="fraction of the tokens kept, in (0, 1] (default 0.5)")
    run.add_argument("--context-tokens", type=int, default=1500, help="length of the essay context (default 1500)")
    run.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    run.add_argument("--question", action="append", metavar="TEXT",
                     help="a question about the document (repeatable; default: ask for the hidden passphrase)")
    run.add_argument("--prefill-chunk", type=int, default=256, help="prefill chunk size (default 256)")
    run.add_argument("--no-hf-baseline", dest="hf_baseline", action="store_false",
                     help="skip the HF transformers StaticCache baseline row")
    run.add_argument("-v", "--verbose", action="store_true", help="log progress of downloads and conversion")

    ev = sub.add_parser(
        "eval", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="quality of every method x budget x context length on real models: JSON, plots, docs/results.md",
        description="Measure how much quality each compression method keeps, against the full cache in the same "
        "run.\n\n"
        "tasks:\n"
        "  nll       continuation NLL: prefill n tokens of Shakespeare, compress to the budget, score the next\n"
        "            --nll-tokens tokens teacher-forced with the compressed cache (nats/token; lower is better)\n"
        "  needle    a passphrase hidden at --depths of n tokens of Paul Graham essays; greedy answer to a\n"
        "            question after the context, exact match (accuracy; higher is better)\n"
        "  fidelity  per layer, relative error of the attention output vs the full cache on --fidelity-steps\n"
        "            decode queries, and the recall of the true top-k attended tokens (ClusterKV's metric)\n\n"
        "budget: fraction of the tokens kept per KV head, B = round(budget * (n + generated tokens)).\n"
        "Results go to OUT/<model>/<task>.json (a rerun of a model and task replaces its file); then the plots\n"
        "and the results page are (re)written from every file in OUT.\n\n"
        "examples:\n"
        "  kvrewrite eval --quick                                  # smoke test, a few minutes on 2 CPU cores\n"
        "  kvrewrite eval --model smollm2-135m --task nll,needle --budgets 0.2,0.5 --context-lengths 1024,2048\n"
        "  kvrewrite eval --report-only                            # redraw plots + docs/results.md from the JSON",
    )
    ev.add_argument("--model", type=_csv(str), action="append", metavar="M[,M...]",
                    help="registry name (smollm2-135m, qwen2.5-0.5b, gemma3-270m), local HF folder or hub id; "
                    "comma-separated or repeated (default: smollm2-135m)")
    ev.add_argument("--methods", type=_csv(str), action="append", metavar="M[,M...]",
                    help="methods to compare (default: all of them); `full` always runs, as the reference")
    ev.add_argument("--budgets", type=_csv(float), action="append", metavar="B[,B...]",
                    help="fractions of the tokens kept, in (0, 1] (default: 0.1,0.2,0.35,0.5)")
    ev.add_argument("--task", type=_csv(str), action="append", metavar="T[,T...]",
                    help="nll, needle and/or fidelity (default: all three)")
    ev.add_argument("--context-lengths", type=_csv(int), action="append", metavar="N[,N...]",
                    help="context lengths in tokens (default: 1024,2048; at most the model's window)")
    ev.add_argument("--quick", action="store_true",
                    help="smoke-test preset: context 512, budgets 0.2,0.5, 32 NLL tokens, 1 needle depth, 4 fidelity "
                    "steps; writes to out/eval-quick (explicit flags override the preset)")
    ev.add_argument("--option", type=_option, action="append", metavar="METHOD.NAME=VALUE",
                    help="a method option, e.g. chelsea.n_recent=32 (repeatable)")
    ev.add_argument("--nll-tokens", type=int, help="tokens scored after each context (default 256)")
    ev.add_argument("--samples", type=int,
                    help="NLL/fidelity samples (different places in the text) per length (default 1)")
    ev.add_argument("--depths", type=_csv(float), action="append", metavar="D[,D...]",
                    help="needle depths as fractions of the context (default 0.1,0.5,0.9)")
    ev.add_argument("--answer-tokens", type=int, help="longest needle answer, in tokens (default 24)")
    ev.add_argument("--fidelity-steps", type=int, help="decode queries compared per context (default 16)")
    ev.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="make every method prefill itself in chunks of N (compressing while it prefills) instead of "
                    "sharing one exact prefill per context (default: shared; see docs/results.md)")
    ev.add_argument("--mode", choices=("whole", "context"),
                    help="whole (default): the whole prompt is compressed; context (needle only): the haystack is "
                    "compressed alone (rw.prefill_context), then the question and the answer run on that cache; "
                    "written to OUT/<model>/needle-context.json")
    ev.add_argument("--out", help="where the JSON goes (default out/eval, or out/eval-quick with --quick)")
    ev.add_argument("--docs", help="results page to write (default docs/results.md, or OUT/results.md with --quick)")
    ev.add_argument("--resume", action="store_true",
                    help="keep the cells OUT/<model>/<task>.json already holds (same task settings only) and measure "
                    "only the missing ones: after an interrupted run, or to add methods, budgets or context lengths")
    ev.add_argument("--no-report", dest="report", action="store_false", help="write the JSON only")
    ev.add_argument("--report-only", action="store_true", help="run nothing: redraw plots and the page from OUT")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument("-v", "--verbose", action="store_true", help="log what the grid does")
    bench = sub.add_parser(
        "bench", help="end-to-end decode/prefill speed and memory on the GPU, kvrewrite methods vs HF transformers",
        description="Random-weight Llama-3.1-8B-shaped model: time per output token, decode tokens/s, prefill time, "
        "peak GPU memory, KV bytes and the roofline floor of every row, kvrewrite methods vs HF StaticCache eager "
        "and compiled, in one run (JSON rewritten after every row, plots at the end). See kvrewrite/bench/e2e.py.")
    from kvrewrite.bench.e2e import add_arguments as _bench_arguments

    _bench_arguments(bench)
    check = sub.add_parser(
        "check", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="verify that the rewrite reproduces HF on a local model folder: max difference per layer, exit 1 on a "
        "mismatch",
        description="Run the rewritten `full` against HF on a synthetic prompt that crosses every sliding window of "
        "the model\n(and stays below its RoPE switch points), compare every decoder layer's output and the logits, "
        "print the table.\nWith weights in the folder the model itself runs; with --config-only or without weights, "
        "a reduced\nrandom-weight copy of its config (a prefix of layers holding every kind of layer, heads and widths "
        "shrunk as\nkvrewrite/verification.py describes: seconds on a CPU for 7-8B configs). Exit status: 0 pass, 1 mismatch "
        "(or the\nmodel is refused), 2 the folder is not a loadable causal LM.\n\n"
        "examples:\n"
        "  kvrewrite check ~/models/Mistral-7B-v0.1 --config-only   # the config's reduced copy, ~10 s on 2 cores\n"
        "  kvrewrite check ./my-finetune --dtype bfloat16           # the weights themselves, in bf16")
    check.add_argument("model_dir", metavar="MODEL_DIR",
                       help="a local Hugging Face model folder (config.json, weights)")
    check.add_argument("--config-only", action="store_true",
                       help="verify a reduced random-weight copy of the config even when the folder has weights")
    check.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="dtype of the run (default float32; the tolerance follows it, see kvrewrite/verification.py)")
    check.add_argument("--attn", choices=("sdpa", "eager"), help="attention implementation (default: HF's choice)")
    check.add_argument("--max-length", type=int, help="longest prompt + decode the run may use (default: the model's)")
    check.add_argument("--prompt-tokens", type=int, help="prompt length (default: past every window, >= 2 chunks)")
    check.add_argument("--new-tokens", type=int, help="decode steps (default 33 with a sliding window, else 8)")
    check.add_argument("--prefill-chunk", type=int, default=256, help="prefill chunk size (default 256)")
    check.add_argument("--atol", type=float, help="tolerance relative to max(1, max |HF|) (default: by dtype)")
    check.add_argument("--no-progress", action="store_true", help="no progress bar")
    check.add_argument("-v", "--verbose", action="store_true", help="log what capture and the passes do")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"run": cmd_run, "eval": cmd_eval, "bench": cmd_bench, "check": cmd_check}[args.command](args)
    except ValueError as e:
        print(f"kvrewrite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
