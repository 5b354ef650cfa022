"""verify: run the rewritten `full` against HF on a synthetic prompt and report the difference per layer.

    report = kvrewrite.verify(model)          # a reduced random-weight copy of model's config
    report = kvrewrite.verify(model, copy=False)  # the model itself, real weights
    print(report); assert report.ok

The prompt: random token ids, batch 2 with row 1 left-padded, long enough that both rows run past
every layer's sliding window (windows as capture reads them off HF's masks) and past the window's
first eviction (kvrewrite.host.WINDOW_INTERVAL), then greedy decode steps (one more than the interval when
the model has a window, so a decode-time eviction happens too), all within max_position_embeddings and
below every RoPE switch point (kvrewrite.rope: apply refuses a max_length past one, so the run stays
where HF and the capture use the same frequencies; the report lists them). The rewrite runs chunked, as
`rw.prefill` / `rw.decode_step` run it; HF runs one prefill forward with a DynamicCache, the 2-D
attention mask and mask-derived position ids, then the same decode tokens (HF's greedy ones: both sides
are teacher-forced on them, so one near-tie cannot make the two runs diverge).

Per layer the decoder layer's output (the residual stream) is compared at every real position: on the
HF side from a forward hook on the decoder layer module (its path is read off the captured graph's
nn_module_stack), on ours from an fx.Interpreter over the rewritten graphs that keeps, per layer, the
last node of that layer (kvrewrite.capture.layer_of) whose value is [B, T, hidden]. A decoder layer's
last hidden-shaped op is its residual add, whatever the family (pre-norm, Gemma's post-norms, parallel
attention + MLP of GPT-J / Phi / Falcon, MoE blocks): checked on all 35 matching cases of the matrix in
tests/families.py (every layer within 6e-7 of HF, relative, in fp32); tests/test_verify.py keeps three.

Tolerance (`TOLERANCE`, per dtype): a layer (and the logits) passes when
max |ours - HF| <= atol * max(1, max |HF|), relative to the tensor's own scale because real residual
streams reach values in the hundreds, where fp32 rounding alone is ~1e-5. Both sides compute the same
math in a different order (chunked fp32 attention with a zero degree bias vs SDPA / eager), so fp32
differences are rounding only (measured <= 1e-6 relative, matrix and 7-9B-shaped copies) and 1e-4 is
generous, yet far below what a wrong window does at the first wrong layer (0.77 relative for no window,
0.37 for a window one token too wide). bf16 and fp16 round every op: HF's bf16 SDPA and our
fp32-accumulated attention differ by a few ulps per layer, and each layer's difference feeds the next;
measured up to 1.9e-2 relative in bf16 (the matrix, 3 seeds of the worst cases) and 1.7e-3 in fp16, so
6e-2 and 1e-2: 3-6x the rounding seen, 5x below the off-by-one window. Within tolerance a greedy token
can only differ on a near-tie (both logits within 2 * atol), so `tokens_equal` is reported and `ok` is
the tolerance check.

Affordable for large models (`copy=True`, the default; `reduced_copy`): a random-weight copy of the
config that keeps what the rewritten attention depends on and shrinks the rest:
- layers: the shortest prefix that holds every distinct kind of layer of the original (a layer's kind:
  its entries in the config's per-layer lists, e.g. layer_types / no_rope_layers, the module classes
  inside it, and its query heads, KV heads, head dim and, when known, window), and at least 2: Gemma-3
  (5 sliding : 1 full) keeps 6 layers, Llama 2. A prefix keeps layer indices, which some models compute
  with (GPT-2's scale_attn_by_inverse_layer_idx).
- kept as they are: head_dim, the query heads per KV head, windows, layer_types, RoPE parameters,
  soft-capping, attention scalars, max_position_embeddings, the attention implementation and the dtype.
- heads: kept when query heads x head_dim <= 1024 (models up to ~1B); above that the copy has
  min(KV heads, 2) KV heads and as many query heads per KV head as the original (MQA: 1 KV head and at
  most 8 query heads, which all read it), and hidden_size = query heads x head_dim. Why this cannot
  change the attention semantics: the rewrite replaces the attention and cache-update nodes, whose math
  is per head (scale, window, soft cap, slot positions) with KV head h serving query heads h*g..h*g+g-1,
  the group g kept; q, k and v (projections, q/k norms, RoPE over head_dim) come from HF's own code,
  captured and run unchanged on both sides. Fewer head groups and a narrower residual stream change
  tensor sizes in the graph, not what any node computes. The copy's captured layers are checked against
  the model's (query/KV heads as the rule shrinks them, head dim; windows too when `layers` is given,
  as apply does); a copy that differs is rebuilt with every head and width kept (the layer prefix only).
- MLP widths (every `*intermediate_size`, n_inner, ffn_hidden_size, ffn_dim) at most 128, experts
  (num_experts / num_local_experts) at most max(4, experts per token), vocab at most 512 (special token
  ids past it become 0 / None): the rewrite does not touch the MLP or the embeddings.
The model's own facts come from `layers`, else from kv_shapes (a one-token forward; shapes only for a
model on the meta device, which is all `kvrewrite check --config-only` builds). Copies are made of
text-only configs (a vision + text model: copy=False). Measured on this 2-core CPU, fp32 (bf16 about the same): a
Llama-3.1-8B-shaped config verifies in ~2 s, a Mistral-7B-v0.1 one (window 4096: a 4,520-token prompt
and 33 decode steps) in ~10 s, Gemma-2-9B (window 4096, soft cap) ~22 s, Gemma-3-4B (6 layers kept)
~20-30 s. With all 32 heads and hidden 4096, the Mistral copy took ~50 s: hence the head rule.
"""
import copy as copylib
import logging
import re
import time
from dataclasses import dataclass, field

import torch
from torch import fx

from kvrewrite.capture import _LAYER, SUPPORTED_MODELS, capture, kv_shapes, layer_of, model_tag, text_config
from kvrewrite.errors import RewriteError
from kvrewrite.host import WINDOW_INTERVAL
from kvrewrite.rope import seq_len_dependent_ropes

logger = logging.getLogger(__name__)

# atol per dtype, relative to max(1, max |HF value|) of each compared tensor (see the module docstring)
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
PAD_PER_ROW = 7  # row j of the synthetic batch is left-padded by j * 7 tokens
DEFAULT_PREFILL_CHUNK = 256  # apply's default
HEAD_WIDTH_KEPT = 1024  # reduced copy: heads kept up to this many query heads x head_dim
MQA_HEADS = 8  # reduced copy of an MQA model wider than that: query heads
SMALL_WIDTH, SMALL_VOCAB, SMALL_EXPERTS = 128, 512, 4
_WIDTH_KEYS = ("n_inner", "ffn_hidden_size", "ffn_dim")
_EXPERT_KEYS = ("num_experts", "num_local_experts")
_auto_reports = {}  # apply's auto-verification, one per reduced config (kvrewrite.eval applies many times)


@dataclass
class LayerDiff:
    """One decoder layer's output, ours vs HF, over every real position of the prompt and decode steps."""

    index: int
    window: int
    max_diff: float
    scale: float  # max |HF output|
    bound: float  # atol * max(1, scale)

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.bound  # NaN fails


@dataclass
class VerifyReport:
    """What `verify` measured. `ok`: every layer and the logits within their bound."""

    model_type: str
    model_tag: str
    dtype: str
    atol: float
    layers: list  # [LayerDiff]
    logits: LayerDiff  # index -1
    tokens_equal: bool
    token_mismatches: list  # [(step, row)]: step 0 is the prompt's last position
    prompt_tokens: int
    new_tokens: int
    batch_size: int
    prefill_chunk: int
    max_length: int
    windows_crossed: tuple
    windows_not_crossed: tuple  # past the longest run max_position_embeddings / RoPE / max_length allow, or the prompt
    rope_thresholds: tuple  # ((module, rope type, switch point), ...): the run stays below them
    copy: str | None  # how the reduced copy differs from the model; None: the model itself
    seconds: float
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.layers) and self.logits.ok

    @property
    def first_mismatch(self) -> int | None:
        """Index of the first layer out of tolerance (None: every layer is within it)."""
        return next((d.index for d in self.layers if not d.ok), None)

    def __str__(self) -> str:
        what = f"reduced copy ({self.copy})" if self.copy else "the model itself"
        pads = ", ".join(str(j * PAD_PER_ROW) for j in range(1, self.batch_size))
        lines = [
            f"kvrewrite verify: {self.model_tag} ({self.model_type}), {what}, {self.dtype}",
            f"run: prompt {self.prompt_tokens} tokens x batch {self.batch_size}"
            + (f" (rows 1.. left-padded by {pads})" if pads else "")
            + f", prefill chunk {self.prefill_chunk}, {self.new_tokens} decode steps, max_length {self.max_length}",
            f"windows crossed: {', '.join(map(str, self.windows_crossed)) or 'none (no sliding window)'}"
            + (f"; not crossed (past the longest run allowed, or a short prompt_tokens): "
               f"{', '.join(map(str, self.windows_not_crossed))}"
               if self.windows_not_crossed else ""),
            "RoPE switch points (the run stays below them): "
            + (", ".join(f"{t} ({rt}, {name})" for name, rt, t in self.rope_thresholds) or "none"),
            f"tolerance: max |ours - HF| <= {self.atol:g} * max(1, max |HF|)",
            "",
            f"{'layer':>6} {'window':>7} {'max |diff|':>11} {'max |HF|':>10} {'bound':>9}",
        ]
        for d in self.layers + [self.logits]:
            name = "logits" if d.index < 0 else str(d.index)
            window = "" if d.index < 0 else (str(d.window) if d.window else "-")
            lines.append(f"{name:>6} {window:>7} {d.max_diff:>11.3g} {d.scale:>10.3g} {d.bound:>9.3g}  "
                         f"{'ok' if d.ok else 'MISMATCH'}")
        steps = self.new_tokens + 1
        if self.tokens_equal:
            lines.append(f"greedy tokens: equal at all {steps} steps x {self.batch_size} rows")
        else:
            where = ", ".join(f"step {s} row {r}" for s, r in self.token_mismatches[:8])
            lines.append(f"greedy tokens: differ at {where}" + (" (near-ties: the logits are within tolerance)"
                                                                 if self.logits.ok else ""))
        lines.extend(self.notes)
        first = self.first_mismatch
        verdict = "PASS" if self.ok else (f"FAIL: first mismatching layer {first}" if first is not None
                                         else "FAIL: the logits are out of tolerance")
        lines.append(f"{verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)


# -- the reduced copy ----------------------------------------------------------------------------------
def decoder_layers(model) -> list:
    """The decoder layer modules: the first ModuleList with one entry per hidden layer."""
    n = text_config(model).num_hidden_layers
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    return []


def _module_kind(layer) -> tuple:
    """The classes inside one decoder layer, expert and head indices collapsed (a dense and an MoE layer differ)."""
    return tuple(sorted({(re.sub(r"\d+", "#", name), type(m).__name__) for name, m in layer.named_modules()}))


def layer_facts(model, layers=None) -> list:
    """[(query heads, KV heads, head dim, window or None)] per layer of `model`: from `layers` (LayerInfo) when
    given, else KV heads and head dim from kv_shapes (a one-token forward; shapes only on the meta device) and
    query heads from the config, else (a forward that fails on meta) from the config alone."""
    tc = text_config(model)
    if layers is not None:
        return [(i.num_heads, i.num_kv_heads, i.head_dim, i.window) for i in layers]
    heads = tc.num_attention_heads
    try:
        return [(heads, hkv, d, None) for hkv, d in kv_shapes(model)]
    except Exception:  # e.g. MoE grouped matmuls that have no meta kernel
        kv = next((getattr(tc, k) for k in ("num_key_value_heads", "num_kv_heads") if getattr(tc, k, None)), heads)
        d = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        return [(heads, kv, d, None)] * tc.num_hidden_layers


def _prefix_length(model, per_layer_keys: list, cfg: dict, facts: list) -> int:
    """The shortest prefix of layers holding every distinct kind of layer of `model` (at least 2)."""
    n = text_config(model).num_hidden_layers
    modules = decoder_layers(model)
    first = {}
    for i in range(n):
        kind = (tuple(repr(cfg[k][i]) for k in per_layer_keys),
                _module_kind(modules[i]) if len(modules) == n else (),
                facts[i] if i < len(facts) else ())
        first.setdefault(kind, i)
    return min(n, max(2, max(first.values()) + 1))


def _shrunk_heads(facts: list):
    """(query heads, KV heads, head dim) of the copy, or None to keep the model's heads."""
    if len({f[:3] for f in facts}) != 1:
        return None  # per-layer head counts: kept as they are
    heads, kv, d = facts[0][:3]
    if heads * d <= HEAD_WIDTH_KEPT or heads % kv:
        return None
    if kv == 1:  # MQA: every query head reads the one KV head, however many there are
        return min(heads, MQA_HEADS), 1, d
    new_kv = min(kv, 2)
    return heads // kv * new_kv, new_kv, d


def _reduced_config(tc, model, facts: list, shrink: bool):
    """A copy of the text config `tc` with the layer prefix and, with `shrink`, heads and widths reduced.
    Returns (config, note, expected (heads, KV heads, head dim) of the copy's layers or None)."""
    cfg = tc.to_dict()
    amap = getattr(tc, "attribute_map", {}) or {}
    key = lambda name: amap.get(name, name)  # noqa: E731  (GPT-2 spells num_hidden_layers n_layer)
    n = tc.num_hidden_layers
    per_layer = [k for k, v in cfg.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 1]
    k = _prefix_length(model, per_layer, cfg, facts)
    cfg[key("num_hidden_layers")] = k
    for name in per_layer:
        cfg[name] = list(cfg[name][:k])
    notes = [f"layers 0-{k - 1} of {n}"]
    expected = _shrunk_heads(facts) if shrink else None
    if expected is not None:
        (heads, kv, d), (new_heads, new_kv, _) = facts[0][:3], expected
        cfg[key("num_attention_heads")] = new_heads
        for name in ("num_key_value_heads", "num_kv_heads"):
            if cfg.get(name):
                cfg[name] = new_kv
        if cfg.get("head_dim"):
            cfg["head_dim"] = d
        cfg[key("hidden_size")] = new_heads * d
        notes.append(f"heads {new_heads}/{new_kv} of {heads}/{kv} (head_dim {d}), hidden {new_heads * d} of "
                     f"{tc.hidden_size}")
    if shrink:
        widths = {name for name, value in cfg.items() if isinstance(value, int) and not isinstance(value, bool)
                  and value > SMALL_WIDTH and (name.endswith("intermediate_size") or name in _WIDTH_KEYS)}
        if "n_inner" in cfg and cfg["n_inner"] is None:  # GPT-2 / GPT-J: None means 4 x hidden
            widths.add("n_inner")
        for name in widths:
            cfg[name] = SMALL_WIDTH
        if widths:
            notes.append(f"{'/'.join(sorted(widths))} {SMALL_WIDTH}")
        for name in _EXPERT_KEYS:
            experts = max(SMALL_EXPERTS, int(cfg.get("num_experts_per_tok") or 1))
            if isinstance(cfg.get(name), int) and cfg[name] > experts:
                notes.append(f"{experts} of {cfg[name]} experts")
                cfg[name] = experts
        vocab = cfg.get("vocab_size")
        if isinstance(vocab, int) and vocab > SMALL_VOCAB:
            cfg["vocab_size"] = SMALL_VOCAB
            for name, value in list(cfg.items()):  # special ids past the new vocab (not used by verify)
                if name.endswith("token_id") and isinstance(value, int) and value >= SMALL_VOCAB:
                    cfg[name] = 0 if name == "pad_token_id" else None
                elif name.endswith("token_id") and isinstance(value, list):
                    cfg[name] = [t for t in value if t < SMALL_VOCAB] or None
            notes.append(f"vocab {SMALL_VOCAB} of {vocab}")
    notes.append("random weights")
    return type(tc).from_dict(cfg), ", ".join(notes), expected


def reduced_copy(model, layers=None, shrink: bool = True, seed: int = 0):
    """A random-weight model of `model`'s type, reduced as the module docstring says.

    Args:
        model: a HF causal LM (its weights are not used; a model on the meta device works).
        layers: the model's LayerInfo list (captured.layers), if known: layer kinds then include windows.
        shrink: False keeps every head and width (only the layer prefix is shrunk).
    Returns (copy, note, facts): `note` says what was reduced; `facts` are the model's
    (query heads, KV heads, head dim, window or None) per layer, that the copy must reproduce (heads as
    the head rule shrinks them).
    """
    from transformers import AutoModelForCausalLM

    if text_config(model) is not model.config:
        raise ValueError(f"kvrewrite.verify: {type(model.config).__name__} holds a text config inside another one "
                         f"(vision + text); reduced copies are made of text-only causal LMs; verify(model, copy=False) "
                         f"runs the model itself")
    facts = layer_facts(model, layers)
    config, note, expected = _reduced_config(model.config, model, facts, shrink)
    device = model.device if model.device.type != "meta" else torch.device("cpu")
    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            copy = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=model.dtype).eval()
    copy.generation_config = copylib.deepcopy(model.generation_config)
    if expected is not None:
        facts = [expected + (f[3],) for f in facts]
    return copy, note, facts


def _faithful(copied: list, facts: list) -> str | None:
    """Why the copy's captured layers differ from the facts it must reproduce (None: they agree)."""
    for c in copied:
        heads, kv, d, window = facts[c.index]
        if (c.num_heads, c.num_kv_heads, c.head_dim) != (heads, kv, d) or window is not None and c.window != window:
            want = f"heads {heads}, KV heads {kv}, head dim {d}" + ("" if window is None else f", window {window}")
            return f"layer {c.index}: the copy has {c}, expected {want}"
    return None


# -- the run -------------------------------------------------------------------------------------------
class _LayerOutputs(fx.Interpreter):
    """Runs a rewritten graph, keeping the value of each layer's output node ({node: layer})."""

    def __init__(self, gm, outputs: dict):
        super().__init__(gm)
        self.outputs = outputs
        self.values = {}

    def run_node(self, n):
        value = super().run_node(n)
        if n in self.outputs:
            self.values[self.outputs[n]] = value
        return value


def layer_output_nodes(gm: fx.GraphModule, batch_size: int, hidden: int) -> dict:
    """{node: layer}: per decoder layer, its last node whose value is [B, T, hidden] (the residual add)."""
    last = {}
    for node in gm.graph.nodes:
        i = layer_of(node)
        val = node.meta.get("val")
        if i is not None and isinstance(val, torch.Tensor) and val.dim() == 3 and \
                val.shape[0] == batch_size and val.shape[2] == hidden:
            last[i] = node
    return {node: i for i, node in last.items()}


def layer_module_paths(gm: fx.GraphModule) -> dict:
    """{layer: path of its decoder layer module in the HF model}, from the captured graph's nn_module_stack
    (paths there are relative to capture's wrapper, whose `model` attribute is the HF model)."""
    paths = {}
    for node in gm.graph.nodes:
        i = layer_of(node)
        if i is None or i in paths:
            continue
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            m = _LAYER.search(path)
            if m and int(m.group(1)) == i and m.end(1) == len(path):
                paths[i] = path[len("model."):] if path.startswith("model.") else path
                break
    return paths


class _Diff:
    """Running max |ours - HF| and max |HF| of one tensor series."""

    def __init__(self):
        self.diff, self.scale = 0.0, 0.0

    def add(self, ours, ref):
        if ref.numel():
            ours, ref = ours.float(), ref.float()
            self.diff = max(self.diff, float((ours - ref).abs().max()))
            self.scale = max(self.scale, float(ref.abs().max()))


def _plan(windows, limit, chunk, prompt_tokens, new_tokens, batch_size):
    """(prompt tokens, decode steps, windows crossed, windows out of reach) of the synthetic run."""
    widest = max((w for w in windows if w < limit), default=0)  # a window at or past the limit is never reached
    if new_tokens is None:
        new_tokens = WINDOW_INTERVAL + 1 if widest else 8
    pad = (batch_size - 1) * PAD_PER_ROW
    if prompt_tokens is None:
        # every row past the widest window and its first eviction, over 2+ chunks, the first one part padding
        prompt_tokens = (widest + WINDOW_INTERVAL + pad if widest else 0) + chunk + chunk // 2 + 1
        prompt_tokens = min(prompt_tokens, limit - new_tokens)
    if prompt_tokens + new_tokens > limit:
        raise ValueError(f"kvrewrite.verify: prompt_tokens={prompt_tokens} + new_tokens={new_tokens} exceeds the "
                         f"longest run this model allows here ({limit} tokens)")
    if prompt_tokens <= pad:
        raise ValueError(f"kvrewrite.verify: a prompt of {prompt_tokens} tokens leaves no real token in a row "
                         f"left-padded by {pad}; give a longer prompt or a larger max_length")
    total = prompt_tokens - pad + new_tokens  # the shortest row's sequence
    crossed = tuple(w for w in windows if total > w)
    return prompt_tokens, new_tokens, crossed, tuple(w for w in windows if w not in crossed)


def _synthetic_batch(cfg, n: int, batch_size: int, device, seed: int):
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch_size, n), generator=g)
    mask = torch.ones_like(ids)
    pad_id = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) and 0 <= cfg.pad_token_id < vocab else 0
    for j in range(1, batch_size):
        mask[j, :j * PAD_PER_ROW] = 0
        ids[j, :j * PAD_PER_ROW] = pad_id  # never attended
    return ids.to(device), mask.to(device)


@torch.no_grad()
def verify(model, *, copy: bool = True, max_length: int | None = None, prompt_tokens: int | None = None,
           new_tokens: int | None = None, batch_size: int = 2, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
           atol: float | None = None, progress: bool = False, layers=None, seed: int = 0) -> VerifyReport:
    """Run the rewritten `full` against HF on a synthetic prompt; report the max difference per layer.

    Args:
        model: a Hugging Face causal LM (with copy=True only its config, dtype and attention implementation
            are used: a model on the meta device works).
        copy: True: verify a reduced random-weight copy of its config (cheap for any size; see the module
            docstring). False: the model itself, real weights.
        max_length: the longest prompt + decode the run may use (default: max_position_embeddings and the
            RoPE switch points bound it); windows beyond it are listed as not reachable.
        prompt_tokens: prompt length (default: past every window and its first eviction, >= 2 chunks).
        new_tokens: decode steps (default: WINDOW_INTERVAL + 1 with a window, so one evicts; else 8).
        batch_size: rows; row j is left-padded by 7 * j tokens.
        prefill_chunk: the rewrite's prefill chunk (apply's default).
        atol: tolerance relative to max(1, max |HF|) per tensor (default: TOLERANCE[dtype]).
        progress: a tqdm bar over the steps of both runs.
        layers: the model's LayerInfo list if already captured (apply passes it): the copy's layer facts
            must then match them, windows included.
        seed: of the copy's weights and the prompt's tokens.
    Returns:
        VerifyReport (`report.ok`, `print(report)` for the table).
    """
    from kvrewrite import _rewrite
    from kvrewrite.capture import check_causal_lm
    from kvrewrite.methods import make_method

    check_causal_lm(model)
    counts = (("batch_size", batch_size, 1), ("prefill_chunk", prefill_chunk, 2), ("max_length", max_length, 2),
              ("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 1))
    for name, value, minimum in counts:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"kvrewrite.verify: {name} must be an int >= {minimum}, got {value!r}")
    if not copy and model.device.type == "meta":
        raise ValueError("kvrewrite.verify: a model on the meta device has no weights to run; verify(model) runs a "
                         "reduced random-weight copy of its config")
    t0 = time.perf_counter()
    tag = model_tag(model)
    dtype = model.dtype
    atol = TOLERANCE.get(dtype, 1e-2) if atol is None else float(atol)
    note, notes = None, []
    target = model
    if copy:
        target, captured, note = _faithful_copy(model, layers, batch_size, prefill_chunk, seed, notes)
    else:
        captured = capture(model, batch_size=batch_size, prefill_chunk=prefill_chunk)
    tc = text_config(target)
    ropes = seq_len_dependent_ropes(target)
    limits = [t for _, _, t in ropes] + [getattr(tc, "max_position_embeddings", None) or 2**31]
    limit = min(limits) if max_length is None else max_length
    if max_length is not None and max_length > min(limits):
        raise ValueError(f"kvrewrite.verify: max_length={max_length} is past what {tag} allows "
                         f"({min(limits)}: max_position_embeddings or a RoPE switch point)")
    windows = tuple(sorted({i.window for i in captured.layers if i.window}))
    n, new, crossed, out_of_reach = _plan(windows, limit, prefill_chunk, prompt_tokens, new_tokens, batch_size)
    rw = _rewrite(target, make_method("full"), captured, n + new)
    ids, mask = _synthetic_batch(tc, n, batch_size, rw._state_device(), seed)
    diffs, logits, mismatches = _compare(target, rw, captured, ids, mask, new, progress)
    report = VerifyReport(
        model_type=model.config.model_type, model_tag=tag, dtype=str(dtype).replace("torch.", ""), atol=atol,
        layers=[LayerDiff(info.index, info.window, diffs[info.index].diff, diffs[info.index].scale,
                          atol * max(1.0, diffs[info.index].scale)) for info in captured.layers],
        logits=LayerDiff(-1, 0, logits.diff, logits.scale, atol * max(1.0, logits.scale)),
        tokens_equal=not mismatches, token_mismatches=mismatches, prompt_tokens=n, new_tokens=new,
        batch_size=batch_size, prefill_chunk=prefill_chunk, max_length=n + new, windows_crossed=crossed,
        windows_not_crossed=out_of_reach, rope_thresholds=tuple(ropes), copy=note,
        seconds=time.perf_counter() - t0, notes=notes)
    return report


def _faithful_copy(model, layers, batch_size, prefill_chunk, seed, notes):
    """(copy, its capture, note): the reduced copy, rebuilt with heads and widths kept when the shrunk one
    cannot be built or does not reproduce the model's layer facts."""
    for shrink in (True, False):
        try:
            copy, note, facts = reduced_copy(model, layers, shrink=shrink, seed=seed)
        except Exception as e:  # a config that refuses the shrunk sizes: keep them
            if not shrink:
                raise
            notes.append(f"note: the shrunk copy could not be built ({type(e).__name__}: {e}); heads and widths kept")
            continue
        captured = capture(copy, batch_size=batch_size, prefill_chunk=prefill_chunk)
        why = _faithful(captured.layers, facts)
        if why is None:
            return copy, captured, note
        if not shrink:
            raise RewriteError(f"{model_tag(model)}: the reduced copy does not reproduce the model's layers ({why}); "
                               f"kvrewrite.verify(model, copy=False) checks the model itself")
        notes.append(f"note: the shrunk copy differs from the model ({why}); rebuilt with heads and widths kept")
    raise AssertionError("unreachable")


def _compare(model, rw, captured, ids, mask, new, progress):
    """Run HF and the rewrite side by side; ({layer: _Diff}, logits _Diff, greedy mismatches [(step, row)])."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    paths = layer_module_paths(captured.graphs["prefill"])
    missing = [i.index for i in captured.layers if i.index not in paths]
    if missing:
        raise RewriteError(f"{captured.model_tag}: verify found no decoder layer module for layers {missing} in the "
                           f"captured graph's nn_module_stack")
    hf_out = {}

    def hook(i):
        def keep(module, args, out):
            hf_out[i] = out[0] if isinstance(out, (tuple, list)) else out
        return keep

    diffs = {i.index: _Diff() for i in captured.layers}
    logits_diff, mismatches = _Diff(), []
    B, n = ids.shape
    chunk = rw.prefill_chunk
    bar = tqdm(total=-(-n // chunk) + 2 * new + 1, desc="verify", unit="step", disable=not progress)
    targets, state = {}, {"chunk": 0, "hf_logits": None}

    def run_graph(name, ids_, pos, cpos, valid):
        graph = {"prefill": rw.prefill_graph, "decode": rw.decode_graph,
                 "decode_compress": rw.decode_compress_graph}[name]
        if name not in targets:
            hidden = next(iter(hf_out.values())).shape[-1]
            targets[name] = layer_output_nodes(graph, B, hidden)
            lost = sorted(set(diffs) - set(targets[name].values()))
            if lost:
                raise RewriteError(f"{captured.model_tag} ({name} graph): verify found no [B, T, {hidden}] output node "
                                   f"for layers {lost}")
        run = _LayerOutputs(graph, targets[name])
        out = run.run(ids_, pos, cpos, valid, *rw.state_tensors())
        if name == "prefill":  # chunk c covers prompt positions c*T - p ... (p: chunk padding on the left)
            lo = state["chunk"] * chunk - (-(-n // chunk) * chunk - n)
            state["chunk"] += 1
            ours_sl, ref_sl = slice(max(0, -lo), None), slice(max(0, lo), lo + chunk)
            real = valid[:, ours_sl]
        else:
            ours_sl, ref_sl, real = slice(None), slice(None), valid
        for node_layer, value in run.values.items():
            diffs[node_layer].add(value[:, ours_sl][real], hf_out[node_layer][:, ref_sl][real])
        logits_diff.add(out[:, ours_sl][real], state["hf_logits"][:, ref_sl][real])
        bar.update(1)
        return out

    handles, was_training = [], model.training
    try:
        model.eval()  # no dropout on the HF side (capture traced the model in eval mode)
        handles += [model.get_submodule(p).register_forward_hook(hook(i)) for i, p in paths.items()]
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = DynamicCache(config=model.config)
        hf = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits
        bar.update(1)
        state["hf_logits"] = hf
        rw._run_graph = run_graph  # rw.prefill / decode_step drive the steps (padding, schedule) as in generate
        ours = rw.prefill(ids, mask, max_new_tokens=new)
        tok, mask_now, next_pos = hf[:, -1].argmax(-1), mask, pos[:, -1] + 1
        mismatches += [(0, r) for r in (ours.argmax(-1) != tok).nonzero().flatten().tolist()]
        for step in range(1, new + 1):
            mask_now = torch.cat([mask_now, torch.ones_like(mask_now[:, :1])], dim=1)
            hf = model(input_ids=tok[:, None], attention_mask=mask_now, position_ids=next_pos[:, None],
                       past_key_values=cache, use_cache=True).logits
            bar.update(1)
            state["hf_logits"] = hf
            ours = rw.decode_step(tok)
            ref_tok = hf[:, -1].argmax(-1)
            mismatches += [(step, r) for r in (ours.argmax(-1) != ref_tok).nonzero().flatten().tolist()]
            tok, next_pos = ref_tok, next_pos + 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        rw.__dict__.pop("_run_graph", None)
        bar.close()
    return diffs, logits_diff, mismatches


def auto_verify(model, captured, prefill_chunk: int, mode) -> None:
    """apply's check: verify the reduced copy when `mode` is True, or "auto" and the model type is outside
    SUPPORTED_MODELS (the tested matrix); RewriteError on a mismatch. mode False: a WARNING when untested."""
    model_type = model.config.model_type
    tested = model_type in SUPPORTED_MODELS
    if mode is False:
        if not tested:
            logger.warning("%s: model type '%s' is outside kvrewrite's tested matrix and apply(verify=False) skipped "
                           "its verification: the rewrite is untrusted (kvrewrite.verify(model) checks it)",
                           captured.model_tag, model_type)
        return
    if mode == "auto" and tested:
        return
    key = (model_type, model.config.to_json_string(), str(model.dtype),
           getattr(model.config, "_attn_implementation", None), prefill_chunk)
    report = _auto_reports.get(key)
    if report is None:
        report = verify(model, copy=True, prefill_chunk=prefill_chunk, layers=captured.layers)
        _auto_reports[key] = report
    if not report.ok:
        raise RewriteError(f"{captured.model_tag}: the rewrite of model type '{model_type}' does not match HF "
                           f"on a reduced copy of its config (verified because "
                           f"{'apply(verify=True)' if mode is True else 'the type is outside the tested matrix'}):\n"
                           f"{report}")
    logger.info("%s: model type '%s' verified on a reduced copy (%s): layers within %.2g, logits %.2g (%.1f s)",
                captured.model_tag, model_type, report.copy, max(d.max_diff for d in report.layers),
                report.logits.max_diff, report.seconds)
