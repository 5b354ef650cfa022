"""Chelsea NLL isolations on SmolLM2 (docs/results-notes.md): Shakespeare passage SAMPLE of 2 (the grid's samples),
1024-token context, 256 scored tokens: a mild budget (0.75) and a longer recent window (n_recent=192 at 0.2).

    PYTHONPATH=. python docs/results/diagnosis/nll_isolation.py 1
"""
import time, sys
import torch, kvrewrite
from kvrewrite.assets import load_model, load_text
from kvrewrite.capture import capture
from kvrewrite.eval.prefill import take_snapshot, load_snapshot
from kvrewrite.eval.grid import make_method, with_budget
from kvrewrite.eval.nll import text_sample, score
model, tok = load_model("smollm2-135m"); text = load_text("shakespeare")
ctx, tgt = text_sample(tok, text, 1024, int(sys.argv[1]), 2, 256)
cap = capture(model, batch_size=1, prefill_chunk=256)
full = kvrewrite.apply(model, "full", max_length=1344, captured=cap)
snap = take_snapshot(full, ctx)
nll = lambda rw: score(rw, load_snapshot(rw, snap, 256), tgt)
t = time.time(); ref = nll(full); print(f"full {ref:.4f} ({time.time()-t:.0f}s)", flush=True)
cells = [("chelsea@0.75", "chelsea", .75, {}), ("chelsea@0.2 n_recent=192", "chelsea", .2, {"n_recent": 192}),
         ("streamingllm@0.75", "streamingllm", .75, {})]
for key, m, b, opts in cells:
    rw = kvrewrite.apply(model, m, 1.0, max_length=1344, captured=cap, **opts)
    assert with_budget(rw, make_method(m, b, **opts))
    t = time.time(); d = nll(rw) - ref
    print(f"{key}: nll_delta {d:+.4f} ({time.time()-t:.0f}s)", flush=True)
