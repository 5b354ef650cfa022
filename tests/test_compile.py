"""torch.compile of the rewritten model on CPU (Inductor, fullgraph=True): no graph break, same logits,
and the layer state updated in place (no copy of it in Inductor's output code).

One family (llama, 2 layers) keeps it short: Inductor's C++ compile of the two step graphs dominates
(about 10 s warm, 30-75 s with a cold Inductor cache on the 2-core CI). The chelsea settings are
small so that the compression op runs inside the compiled steps: prompt 24 tokens (row 1 has 5
pads), 12 new tokens -> target B = round(0.5 * 36) = 18, threshold B + g = 22; prefill leaves
18 slots and decode steps 4, 8, 12 compress back to 18.
"""
import math
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kvrewrite
from tests.families import tiny_model

# Inductor reorders and fuses fp32 reductions (RMSNorm, softmax, matmul epilogues): rounding only.
# Chelsea's merge decisions (argmax of cosine similarities) see the same rounding; with random keys
# no near-tie flips, so the same tolerance holds after compression.
TOL = dict(atol=1e-5, rtol=1e-5)
PROMPT, PAD_ROW1, NEW, CHUNK, MAX_LENGTH = 24, 5, 12, 16, 40
CHELSEA = dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)
# the score methods: their observation op runs in every compiled step, their compression on steps 4, 8, 12
H2O = dict(budget=0.5, interval=4)
SNAPKV = dict(budget=18, window=4, kernel=7, interval=4)
# ClusterKV: layer 1 selects (its select op and indexed attention in every compiled decode step), and clusters
# the 4 newest tokens into 2 clusters at steps 4, 8, 12 (kmeans_cluster in the compressing variant)
# KVMerger: observation as H2O's, kvmerger_compress back to B = 18 (chain/exact) on steps 4, 8, 12
KVMERGER = dict(budget=0.5, interval=4)
# EMS: ems_append + ems_attention (its own attention, statistics folded) in every step, ems_compress back to B = 18
# entries on steps 4, 8, 12
EMS = dict(budget=0.5, window=4, kernel=3, interval=4)
# ClusterGen: sketch_attention in every step, clustergen_fold of the tokens leaving its 4-token window on steps 4, 8,
# 12 (the sketch: 2 sinks + 4 window exact, B = 20 slots); the k-center variant: kcenter_compress back to B = 18
CLUSTERGEN = dict(budget=0.5, n_sink=2, window=4, t=2, interval=4)
KCENTER = dict(budget=0.5, interval=4)
CLUSTERKV = dict(budget=10, n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=3, dense_layers=1)
METHODS = {"full": {}, "chelsea": CHELSEA, "h2o": H2O, "snapkv": SNAPKV, "clusterkv": CLUSTERKV, "kvmerger": KVMERGER,
           "ems": EMS, "clustergen": CLUSTERGEN, "clustergen-kcenter": KCENTER}
STREAMINGLLM = dict(budget=0.5, n_sink=2, interval=4)
COMPRESSION_OPS = {"chelsea": "chelsea_compress", "streamingllm": "evict_to_budget", "h2o": "evict_by_score",
                   "kvmerger": "kvmerger_compress", "ems": "ems_compress", "clustergen": "clustergen_fold",
                   "clustergen-kcenter": "kcenter_compress"}
BIG_FIELDS = ("keys", "values", "bias", "slot_pos")  # fill [B, Hkv] and budget [2] are tiny




@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None  # every row generates all NEW tokens
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def captured(model):
    """One capture (batch 2, chunks of CHUNK) that every test rewrites: a capture is most of an apply's time, and
    what is compiled here is each rewrite's own graphs."""
    from kvrewrite.capture import capture

    return capture(model, batch_size=2, prefill_chunk=CHUNK)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    return ids, mask


def _fills(rw):
    return [getattr(rw, f"l{info.index}_fill").clone() for info in rw.layers]


@torch.no_grad()
def _decode(step_fn, rw, tokens):
    """Run the decode steps with step_fn(ids, pos, cpos, valid); logits [steps, B, V] and fills per step."""
    pos, cpos = rw._next_position.clone(), rw._next_cache_position
    valid = torch.ones(2, 1, dtype=torch.bool)
    logits, fills = [], []
    for s, tok in enumerate(tokens):
        logits.append(step_fn(tok[:, None], (pos + s)[:, None], torch.tensor([cpos + s]), valid)[:, -1])
        fills.append(_fills(rw))
    return torch.stack(logits), fills


@pytest.mark.parametrize("method", list(METHODS))
@torch.no_grad()
def test_compiled_decode_step_matches_eager(model, captured, method):
    """Eager prefill, then NEW decode steps eager and (from the same state) compiled, fed the same tokens."""
    rw = kvrewrite.apply(model, method, max_length=MAX_LENGTH, captured=captured, **METHODS[method])
    ids, mask = _inputs()
    rw.prefill(ids, mask, max_new_tokens=NEW)
    saved = [t.clone() for t in rw.state_tensors()]
    tokens = torch.randint(3, 128, (NEW, 2), generator=torch.Generator().manual_seed(3))

    eager, eager_fills = _decode(rw, rw, tokens)
    eager_state = {name: t.clone() for name, t in rw.named_buffers() if name.startswith("l")}
    for t, s in zip(rw.state_tensors(), saved):  # back to the post-prefill state, same tensors
        t.copy_(s)
    compiled = torch.compile(rw, fullgraph=True)  # raises on any graph break
    ours, our_fills = _decode(compiled, rw, tokens)

    if method == "clusterkv":  # the window clusterings ran inside the compiled steps
        assert int(rw.l1_n_clusters.min()) == 5 + 3 * 2, rw.l1_n_clusters
    elif method == "clustergen":  # folds back to the 2 sinks + 4 window exact inside the compiled steps
        l0 = [int(f[0].max()) for f in our_fills]
        assert l0.count(6) >= 2 and max(l0) == 9, f"layer-0 exact slots per step {l0}: expected folds back to 6"
    elif method != "full":  # compression really ran inside the compiled steps
        l0 = [int(f[0].max()) for f in our_fills]
        assert l0.count(18) >= 2 and max(l0) == 21, f"layer-0 fill per step {l0}: expected compressions back to 18"
    for info, specs in zip(rw.layers, rw.state_specs):  # the method's own state (scores) too
        for name in specs:
            ours_s, eager_s = getattr(rw, f"l{info.index}_{name}"), eager_state[f"l{info.index}_{name}"]
            assert torch.allclose(ours_s, eager_s, **TOL), f"{method}: {name} of layer {info.index} differs compiled"
    for s, (a, b) in enumerate(zip(eager_fills, our_fills)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{method}: fill differs at step {s}: {a} vs {b}"
    diff = (ours - eager).abs().max().item()
    assert torch.allclose(ours, eager, **TOL), f"{method}: compiled vs eager decode logits: max abs diff {diff:.3g}"
    print(f"{method}: compiled vs eager max abs diff {diff:.3g}")


@pytest.mark.parametrize("method", ["chelsea", "h2o", "snapkv"])
@torch.no_grad()
def test_module_compile_in_place_generate_matches_eager(model, captured, method):
    """rw.compile(fullgraph=True) (nn.Module.compile) makes generate run compiled (prefill chunks and decode);
    for H2O and SnapKV the prefill chunks hold the observation op too."""
    rw = kvrewrite.apply(model, method, max_length=MAX_LENGTH, captured=captured, **METHODS[method])
    ids, mask = _inputs()
    eager = rw.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    torch._dynamo.utils.counters.clear()
    rw.compile(fullgraph=True)
    compiled = rw.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2, f"expected the prefill-chunk and decode steps compiled, dynamo compiled {graphs} graphs"
    assert torch.equal(compiled, eager), f"compiled generate\n{compiled[:, PROMPT:]}\n!= eager\n{eager[:, PROMPT:]}"


@torch.no_grad()
def test_compiled_prefill_does_not_recompile_for_another_prompt_length(model, captured):
    """The prefill chunks reach the compiled step with the same strides whatever the prompt length (Dynamo
    guards on strides: slices of the [B, n] prompt recompiled the whole prefill graph for each new n, which
    cost 70 s per prompt length on a Llama-8B on an H100)."""
    rw = kvrewrite.apply(model, "chelsea", max_length=64, captured=captured, **CHELSEA)
    g = torch.Generator().manual_seed(5)
    short, long = (torch.randint(3, 128, (2, n), generator=g) for n in (20, 40))
    eager = rw.prefill(long, max_new_tokens=4)
    rw.compile(fullgraph=True)
    rw.prefill(short, max_new_tokens=4)  # compiles the prefill-chunk step
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = rw.prefill(long, max_new_tokens=4)
    torch.testing.assert_close(compiled, eager, **TOL)


def _state_sized_buffers(code: str, numels: set) -> list:
    """Buffers Inductor allocates with as many elements as a keys/values/bias/slot_pos tensor: each one
    is a copy of a layer's state (a clone before an op, or a functional write later copied back);
    counted by element count so that flattened copies (empty_strided((numel,), ...)) count too."""
    found = []
    for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code):
        dims = [int(d) for d in shape.replace(" ", "").split(",") if d]
        if math.prod(dims) in numels:
            found.append(tuple(dims))
    return found


@pytest.mark.parametrize("method", ["chelsea", "streamingllm", "h2o", "kvmerger", "ems", "clustergen",
                                    "clustergen-kcenter"])
@torch.no_grad()
def test_compiled_decode_updates_state_in_place(model, captured, method):
    """Both compiled decode variants run cache_append and the compression op on the state's own
    tensors: no state-sized buffer anywhere in the output code, and every compression op is called
    on graph inputs (the state), not on copies. Regression test: with the compression op right after
    the attention, Inductor cloned each layer's whole state around it and copied it back (>= 4 GB per
    compressing step at 32k; see kvrewrite/passes/insert_cache_compression.py).
    H2O (the score methods): the score, updated by the observation op and then handed to evict_by_score,
    is materialised once on compressing steps (4 bytes per slot and KV head, the size of `bias`), so only
    keys/values-sized buffers are looked for; the state arguments of the op are checked as for the others."""
    kwargs = {"chelsea": CHELSEA, "streamingllm": STREAMINGLLM, "h2o": H2O, "kvmerger": KVMERGER, "ems": EMS,
              "clustergen": CLUSTERGEN, "clustergen-kcenter": KCENTER}[method]
    rw = kvrewrite.apply(model, method, max_length=MAX_LENGTH, captured=captured, **kwargs)
    ids, mask = _inputs()
    rw.prefill(ids, mask, max_new_tokens=NEW)
    fields = ("keys", "values") if rw.state_specs[0] else BIG_FIELDS
    numels = {getattr(rw, f"l{info.index}_{f}").numel() for info in rw.layers for f in fields}
    step = (ids[:, :1], rw._next_position[:, None], rw._next_cache_position, torch.ones(2, 1, dtype=torch.bool))
    compiled = torch.compile(rw, fullgraph=True)
    for compress in (True, False):
        _, codes = run_and_get_code(lambda: compiled(*step, compress=compress))
        code = "\n".join(codes)
        assert any(a in code for a in ("clustered_attention", "observed_attention", "ems_attention",
                                       "sketch_attention")), \
            "no compiled decode graph in the captured output code"
        copies = _state_sized_buffers(code, numels)
        assert not copies, f"{method} compress={compress}: state-sized buffers (copies of the state) {copies}"
        op = COMPRESSION_OPS[method]
        calls = re.findall(rf"torch\.ops\.kvrewrite\.{op}\.default\(([^)]*)\)", code)
        want = len(rw.layers) if compress else 0
        assert len(calls) == want, f"{method} compress={compress}: {len(calls)} {op} calls, expected {want}"
        for call in calls:
            state_args = [a.strip() for a in call.split(",")[:4]]
            assert all(re.fullmatch(r"arg\d+_1", a) for a in state_args), \
                f"{method}: {op} runs on {state_args}, not on the graph's state inputs (a copy)"


@torch.no_grad()
def test_every_model_of_a_process_has_its_own_compile_cache(model, captured):
    """Dynamo keeps one cache of compiled variants per code object, and counts its recompiles against
    recompile_limit (8). Every KVRewrittenModel shared one forward, so each model compiled in a process added its
    step variants (prefill chunk, decode, compressing decode) to one count: the third method of one `kvrewrite
    bench --kv-compile inductor --batch-prefill` process failed with FailOnRecompileLimitHit (an H200, stop 40).
    rw.compile gives each model a forward of its own: with a limit of 3, four models compile three variants each."""
    ids, mask = _inputs()
    with torch._dynamo.config.patch(recompile_limit=3):
        for method in ("h2o", "snapkv", "chelsea", "h2o"):
            rw = kvrewrite.apply(model, method, max_length=MAX_LENGTH, captured=captured, **METHODS[method])
            rw.compile(fullgraph=True, backend="eager")
            rw.generate(ids, attention_mask=mask, max_new_tokens=NEW)
            assert rw.forward.__code__ is not type(rw).forward.__code__
