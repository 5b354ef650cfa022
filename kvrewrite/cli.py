"""`kvrewrite` command line. `kvrewrite run` is the main job: a real model, a long prompt, the full
cache against a compressed one, answers, KV memory and time side by side."""
import argparse
import logging
import sys
import time

import torch

NEEDLE = "The secret passphrase for the archive is 'amber-falcon-42'."
QUESTION = "What is the secret passphrase for the archive? Answer with the passphrase only."


def _long_prompt(tokenizer, context_tokens: int) -> str:
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


def _hf_static_row(model, tok, enc, n, max_new_tokens, dense):
    """What a user would otherwise run: HF generate with a StaticCache, greedy, same prompt."""
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **kw)
        t_total = time.perf_counter() - t0
    new = out[0, n:]
    answer = tok.decode(new, skip_special_tokens=True).strip()
    print(f"[hf-static] answer: {answer!r}\n", flush=True)
    tps = (len(new) - 1) / max(t_total - t_prefill, 1e-9)
    return ("hf-static", answer, {"kvrewrite": dense, "dense": dense}, model.config.num_hidden_layers * (n + len(new)),
            0.0, t_prefill, tps)


def cmd_run(args) -> int:
    import kvrewrite
    from kvrewrite.assets import load_model

    torch.manual_seed(0)
    print(f"loading {args.model} ...", flush=True)
    model, tok = load_model(args.model)
    context = _long_prompt(tok, args.context_tokens)
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    if getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        prompt = messages[0]["content"] + "\n"
    enc = tok(prompt, return_tensors="pt", add_special_tokens=not getattr(tok, "chat_template", None))
    n = enc["input_ids"].shape[1]
    max_length = n + args.max_new_tokens
    print(f"prompt: {n} tokens (needle in the middle); generating up to {args.max_new_tokens} tokens\n", flush=True)
    rows = []
    for method in ["full", args.method] if args.method != "full" else ["full"]:
        opts = {} if method == "full" else {"budget": args.budget}
        t0 = time.perf_counter()
        rw = kvrewrite.apply(model, method, max_length=max_length, prefill_chunk=args.prefill_chunk, **opts)
        t_apply = time.perf_counter() - t0
        out = rw.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=args.max_new_tokens, progress=True)
        new = out[0, n:]
        t_prefill, t_decode = rw.last_timings["prefill_s"], rw.last_timings["decode_s"]
        answer = tok.decode(new, skip_special_tokens=True).strip()
        mem = rw.cache_bytes(seq_len=n + args.max_new_tokens)
        used = sum(int(rw.layer_state(i.index)["fill"].max()) for i in rw.layers)
        rows.append((method, answer, mem, used, t_apply, t_prefill, rw.last_timings["new_tokens"] / t_decode))
        print(f"[{method}{'' if method == 'full' else f' budget={args.budget}'}] answer: {answer!r}\n", flush=True)
    if args.hf_baseline:
        rows.insert(0, _hf_static_row(model, tok, enc, n, args.max_new_tokens, rows[0][2]["dense"]))
    dense = rows[0][2]["dense"]
    print(f"{'method':<14}{'KV state':>12}{'vs dense':>10}{'slots used':>12}{'capture s':>11}{'prefill s':>11}{'decode tok/s':>14}")
    for method, _, mem, used, t_apply, t_prefill, tps in rows:
        print(f"{method:<14}{_human(mem['kvrewrite']):>12}{mem['kvrewrite'] / dense:>9.0%} {used:>11}"
              f"{t_apply:>11.1f}{t_prefill:>11.1f}{tps:>14.1f}")
    print(f"(dense HF static cache for {n + args.max_new_tokens} tokens: {_human(dense)}; kvrewrite's state is as "
          f"allocated, including the prefill chunk and g headroom; 'slots used' summed over layers at the end; "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__})")
    print("needle found: " + ", ".join(f"{r[0]}={'amber-falcon-42' in r[1]}" for r in rows))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvrewrite", description="Compress the KV cache of Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: full vs compressed cache on a real model and a long prompt")
    run.add_argument("--model", default="smollm2-135m", help="registry name (smollm2-135m, qwen2.5-0.5b, gemma3-270m), local HF folder or hub id")
    run.add_argument("--method", default="chelsea", help="compression method to compare with full (default: chelsea)")
    run.add_argument("--budget", type=float, default=0.5, help="fraction of the tokens kept, in (0, 1] (default 0.5)")
    run.add_argument("--context-tokens", type=int, default=1500, help="length of the essay context (default 1500)")
    run.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    run.add_argument("--prefill-chunk", type=int, default=256, help="prefill chunk size (default 256)")
    run.add_argument("--no-hf-baseline", dest="hf_baseline", action="store_false",
                     help="skip the HF transformers StaticCache baseline row")
    run.add_argument("-v", "--verbose", action="store_true", help="log progress of downloads and conversion")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"run": cmd_run}[args.command](args)
    except ValueError as e:
        print(f"kvrewrite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
