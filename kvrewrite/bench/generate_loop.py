"""rw.generate's token loop (kvrewrite.generation.decode_loop) on the GPU: what it costs per step on top of the decode
step, measured over a stub step that returns fixed logits (no model), so the loop's own kernels, launches and host
syncs are all there is.

Vocabulary 128256 (Llama 3), bf16 logits, batch 1 and 8, 256 new tokens. Settings (each takes its own path):
- greedy, no EOS: the fast path (greedy_tokens on the raw logits, no device read until the end);
- greedy, EOS: the fast path with the EOS test and one host sync per step (as HF's loop);
- greedy + output_scores, repetition_penalty, sampling (top_k 50, top_p 0.9): HF's processors on a float32 copy;
- floor: the stub step and greedy_tokens alone, without and with a sync per step.
Per setting: the median over 5 runs of the wall time per step (the loop synchronises at its end).

    python -m kvrewrite.bench.generate_loop --out docs/bench/generate_loop_h100.json
"""
import argparse
import json
import statistics
import time
import types

import torch
from transformers import GenerationConfig

from kvrewrite.generation import GenerationPlan, decode_loop
from kvrewrite.host import greedy_tokens

V, STEPS, N_PROMPT, RUNS = 128256, 256, 16, 5
SETTINGS = {
    "greedy": dict(eos_token_id=None),
    "greedy_eos": dict(eos_token_id=7),
    "greedy_scores": dict(eos_token_id=7, return_dict_in_generate=True, output_scores=True),
    "greedy_repetition_penalty": dict(eos_token_id=7, repetition_penalty=1.1),
    "sample_top_k_top_p": dict(eos_token_id=7, do_sample=True, top_k=50, top_p=0.9),
}


def _owner(batch):
    return types.SimpleNamespace(model_tag="stub", batch_size=batch, BATCH_FIXED_BY="captured", config=None,
                                 vocab_size=V, generation_config=GenerationConfig(pad_token_id=0))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn) -> float:
    """Median seconds per step of fn() over RUNS runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(RUNS):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - t0) / STEPS)
    return statistics.median(out)


def run(batch: int, device="cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, V, device=device, generator=g).to(torch.bfloat16)
    logits[:, 3] = 30.0  # the argmax: never the EOS (7), so every run makes STEPS steps
    prompt = torch.randint(10, V, (batch, N_PROMPT), device=device, generator=g)
    step = lambda tok: logits  # noqa: E731  (the stub decode step)
    res = {}
    for name, kw in SETTINGS.items():
        plan = GenerationPlan.build(_owner(batch), prompt, None, None, dict(kw, max_new_tokens=STEPS), None, None,
                                    torch.device(device))

        def loop():
            new, _, _ = decode_loop(plan, logits, plan.input_ids, step, generator=g)
            assert new.shape[1] == STEPS, new.shape

        res[name] = _time(loop) * 1e6

    def floor(sync):
        def f():
            for _ in range(STEPS):
                tok = greedy_tokens(step(None))
                if sync:
                    bool(tok.any())
        return f

    res["floor"] = _time(floor(False)) * 1e6
    res["floor_sync"] = _time(floor(True)) * 1e6
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import transformers

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "vocab": V, "steps": STEPS, "unit": "us per step (median of 5 runs)",
           "batch": {str(b): run(b) for b in (1, 8)}}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
