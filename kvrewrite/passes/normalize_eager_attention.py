"""Rewrite HF's eager attention (matmul -> scale -> +mask -> softmax -> matmul) into one SDPA node.

Matches:  the region of HF's `eager_attention_forward`, anchored on aten.softmax.int over the last dim:
              scores = aten.matmul(q, aten.transpose.int(k, 2, 3))        q [B, Hq, T, D], k [B, Hq, S, D]
              scaled = aten.mul.Tensor(scores, scaling)                   scaling a Python number
                       (or aten.div.Tensor(scores, 1 / scaling): GPT-J)
              capped = aten.mul(aten.tanh(aten.div(scaled, cap)), cap)    optional soft cap (Gemma-2)
              masked = aten.add.Tensor(capped, mask)                      optional (no mask: no add)
              probs  = aten.softmax.int(masked, -1, float32)
                       aten.to.dtype(probs, q.dtype)                      optional (or aten._to_copy)
                       aten.dropout(., p, train)                          optional; p == 0 or not train
              out    = aten.matmul(., v)                                  v [B, Hq, S, D], out [B, Hq, T, D]
          k and v are HF's repeat_kv outputs. Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma-3 all spell it
          this way in the captured training IR (transformers 5.17 and 5.23); the matmuls are not decomposed.
          GPT-J casts q and k to fp32 first: q's cast is dropped when its source has the output's dtype
          (kvrewrite::clustered_attention computes the scores in fp32 anyway).
Emits:    one aten.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling) per region, with the
          val and nn_module_stack of the value matmul it replaces (same [B, Hq, T, D] output, still before
          HF's transpose(1, 2)); k/v stay the repeat_kv views, so locate_attention_sites traces them to the
          cache buffers. The rest of the region is erased. A soft cap is kept in the SDPA node's
          meta[SOFTCAP_META] (SDPA cannot express it; replace_sdpa_with_clustered_attention passes it on).
Skips:    (logged at DEBUG with the softmax node and the reason) a region whose intermediates escape (e.g.
          returned attention weights, output_attentions=True), a tanh that is not the soft cap, active
          dropout, a softmax over another dim, a mask of neither bool nor q's dtype, or any other spelling.
          No rewrite is ever partial: a skipped layer keeps its whole eager region (and its softmax), so
          locate_attention_sites then reports it as a layer without an attention site.
Requires: capture only; runs first.
"""
import logging
import numbers

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.passes.utils import clean_up, val_shape

logger = logging.getLogger(__name__)
aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
SOFTMAX = aten.softmax.int
MATMUL = aten.matmul.default
CASTS = (aten.to.dtype, aten._to_copy.default)  # softmax(..., dtype=float32).to(query.dtype)
DROPOUT = aten.dropout.default
TANH = aten.tanh.default  # Gemma-2/3 attn_logit_softcapping: ((s * scaling) / cap).tanh() * cap
# An SDPA node emitted for soft-capped scores carries the cap here: SDPA itself cannot cap, so until
# replace_sdpa_with_clustered_attention hands it to kvrewrite::clustered_attention(softcap=...), that node
# is the graph's attention only together with this annotation (the passes run as one unit).
SOFTCAP_META = "kvrewrite_softcap"


class _NoMatch(Exception):
    """Why a softmax is not the anchor of a rewritable eager attention."""


def _is_call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _only_user(node: fx.Node, what: str) -> fx.Node:
    """The single user of an intermediate; more than one means the intermediate escapes the attention."""
    if len(node.users) != 1:
        raise _NoMatch(f"the {what} '{node.name}' escapes: used by {sorted(u.name for u in node.users)}")
    return next(iter(node.users))


def _match(softmax: fx.Node) -> dict:
    """Walk back from the softmax to the score matmul and forward to the value matmul.

    Returns q, k, v, mask (or None), scale, the value matmul `out`, and `region`: the nodes to erase,
    users before producers.
    """
    before, after = [], []  # producers of the softmax input / consumers of its output, inside the region
    dim = _arg(softmax, 1, "dim")
    ndim = len(val_shape(softmax))
    if ndim != 4 or dim not in (-1, ndim - 1):
        raise _NoMatch(f"softmax over dim {dim} of a {ndim}-D tensor, expected the last dim of [B, Hq, T, S]")

    # backwards: [add(mask)] <- [softcap: mul(tanh(div(., cap)), cap)] <- mul(scaling) | div(1 / scaling)
    #            <- matmul(q, transpose(k))
    node, mask, softcap = softmax.args[0], None, 0.0
    if _is_call(node, (aten.add.Tensor,)) and isinstance(node.args[1], fx.Node) and len(node.args) == 2:
        before.append(node)
        node, mask = node.args[0], node.args[1]
    if _is_call(node, (aten.mul.Tensor,)) and _is_call(node.args[0], (TANH,)):
        tanh = node.args[0]
        inner = tanh.args[0]
        cap = node.args[1]
        if not (isinstance(cap, numbers.Real) and _is_call(inner, (aten.div.Tensor,)) and inner.args[1] == cap and cap > 0):
            raise _NoMatch(f"a tanh before the softmax ('{tanh.name}') that is not the soft cap cap * tanh(s / cap)")
        softcap = float(cap)
        before += [node, tanh, inner]
        node = inner.args[0]
    if _is_call(node, (aten.mul.Tensor,)) and isinstance(node.args[1], numbers.Real):
        scale = float(node.args[1])
    elif _is_call(node, (aten.div.Tensor,)) and isinstance(node.args[1], numbers.Real) and node.args[1]:
        scale = 1.0 / float(node.args[1])  # GPT-J: scores / sqrt(D)
    else:
        raise _NoMatch(f"expected scores * scaling (or / its inverse) before the softmax, found "
                       f"'{getattr(node, 'name', node)}'")
    before.append(node)
    node = node.args[0]
    if _is_call(node, (TANH,)):
        raise _NoMatch(f"a tanh ('{node.name}') between the score matmul and its scaling")
    if not _is_call(node, (MATMUL,)):
        raise _NoMatch(f"expected the score matmul, found '{getattr(node, 'name', node)}'")
    scores = node
    before.append(scores)
    q, kt = scores.args
    if not (_is_call(kt, (aten.transpose.int,)) and {d % 4 for d in kt.args[1:3]} == {2, 3}):
        raise _NoMatch(f"expected matmul(q, k.transpose(2, 3)), found '{getattr(kt, 'name', kt)}' as the key")
    k = kt.args[0]
    for n in before:
        _only_user(n, "attention scores")

    # forwards: [to(q.dtype)] -> [dropout(p=0)] -> matmul(., v)
    node = _only_user(softmax, "attention weights")
    if _is_call(node, CASTS):
        after.append(node)
        node = _only_user(node, "attention weights")
    if _is_call(node, (DROPOUT,)):
        p, train = _arg(node, 1, "p"), _arg(node, 2, "train")
        if p and train:
            raise _NoMatch(f"active dropout (p={p}, train={train}); call model.eval()")
        after.append(node)
        node = _only_user(node, "attention weights")
    if not (_is_call(node, (MATMUL,)) and node.args[0] is (after or [softmax])[-1]):
        raise _NoMatch(f"expected the value matmul after the softmax, found '{node.name}' ({node.target})")
    out, v = node, node.args[1]

    if _is_call(q, CASTS) and _val(q.args[0]) is not None and _val(out) is not None \
            and _val(q.args[0]).dtype == _val(out).dtype:
        q = q.args[0]  # GPT-J casts q (and k) to fp32 for the scores: the op computes scores in fp32 anyway
    qv, kv, vv, ov = _val(q), _val(k), _val(v), _val(out)
    if qv is None or kv is None or vv is None or ov is None:
        raise _NoMatch("q, k, v or the output has no meta['val']")
    shapes = f"{tuple(qv.shape)}, {tuple(kv.shape)}, {tuple(vv.shape)} and {tuple(ov.shape)} {ov.dtype}"
    if not qv.dim() == kv.dim() == vv.dim() == 4:
        raise _NoMatch(f"expected 4-D q, k, v and output, got {shapes}")
    B, H, T, _ = qv.shape
    # k/v are repeat_kv'd (Hq heads, like q); the output is [B, Hq, T, D], before HF's transpose(1, 2).
    if (tuple(kv.shape[:2]) != (B, H) or tuple(vv.shape[:2]) != (B, H)
            or tuple(ov.shape) != (B, H, T, vv.shape[3]) or ov.dtype != qv.dtype):
        raise _NoMatch(f"expected q [B, Hq, T, D], k/v [B, Hq, S, D] and output [B, Hq, T, D] of q's dtype, "
                       f"got {shapes}")
    mv = _val(mask)
    if mask is not None and (mv is None or mv.dtype not in (torch.bool, qv.dtype)):
        raise _NoMatch(f"the mask '{mask.name}' is {getattr(mv, 'dtype', None)}; SDPA needs bool or {qv.dtype}")
    region = [out, *reversed(after), softmax, *before]
    return dict(q=q, k=k, v=v, mask=mask, scale=scale, softcap=softcap, out=out, region=region)


def normalize_eager_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    count = 0
    for softmax in [n for n in graph.nodes if _is_call(n, (SOFTMAX,))]:
        try:
            m = _match(softmax)
        except _NoMatch as e:
            logger.debug("normalize_eager_attention: %s: skipped: %s", ctx.where(node=softmax), e)
            continue
        out = m["out"]
        kwargs = {"scale": m["scale"]} if m["mask"] is None else {"attn_mask": m["mask"], "scale": m["scale"]}
        with graph.inserting_before(out):
            sdpa = graph.call_function(SDPA, (m["q"], m["k"], m["v"]), kwargs)
        sdpa.meta.update({k: v for k, v in out.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        if m["softcap"]:
            sdpa.meta[SOFTCAP_META] = m["softcap"]
        out.replace_all_uses_with(sdpa)
        # Erase explicitly, users first: DCE keeps aten.dropout (random ops count as impure).
        for node in m["region"]:
            graph.erase_node(node)
        count += 1
    ctx.counters["normalize_eager_attention"] += count
    logger.debug("normalize_eager_attention: rewrote %d eager attention regions into SDPA", count)
    return clean_up(gm) if count else gm
