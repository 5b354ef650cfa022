"""Functional forms of the state-mutating kvrewrite ops, and the pass that rewrites a graph onto them.

ONNX and TensorRT have no in-place mutation of graph inputs: a node returns new tensors. For those
targets the rewritten graph (signature (input_ids, position_ids, cache_position, token_valid, *state),
state updated in place, output logits) becomes a graph with the same inputs whose output is
(logits, *new_state); every kvrewrite::cache_append / evict_to_budget / chelsea_compress /
evict_by_score / accumulate_attention becomes the op of the same name in the namespace
``kvrewrite_export``, which takes the same arguments (chelsea's outlier heads as a bit mask) and returns
the tensors it would write instead of mutating them: (keys, values, bias, slot_pos, fill) for the first
three, those plus the score and the order for evict_by_score, the score for accumulate_attention (FUNCTIONAL lists the
mutated argument positions), kvrewrite::kmeans_cluster (ClusterKV) becomes kvrewrite_export::kmeans_cluster,
which returns its six index fields (centroids, cluster_size, cluster_start, members, n_clusters, cluster_end),
and kvrewrite::kvmerger_compress (KVMerger) becomes kvrewrite_export::kvmerger_compress, which returns (keys,
values, bias, slot_pos, fill, score, degree, deficit); ClusterGen's kvrewrite::clustergen_fold and clustergen-kcenter's
kvrewrite::kcenter_compress become kvrewrite_export::clustergen_fold (returning the thirteen fields it writes: the
base five, role, rep, count, n_clusters, mu, delta, n_seen, n_forced) and kvrewrite_export::kcenter_compress (the
base five); EMS's kvrewrite::ems_append, ems_attention and ems_compress become kvrewrite_export::ems_append (returning
the seven slot-table fields it writes), ems_attention (returning the attention's output, then s_glo, s_loc_past,
s_loc_cur and win_count: RETURNS lists the in-place ops whose own return comes first) and ems_compress (returning the
fifteen fields it writes: every argument but budget). A kvrewrite op that writes its inputs and has no entry
in FUNCTIONAL is refused by `functionalize` (ValueError naming it): it cannot slip through an export.
Their eager and CUDA kernels are the in-place ops applied to clones, so the functional graph computes exactly
what the in-place one does. clustered_attention, select_clusters, indexed_attention, sketch_attention and
attention_column_stats mutate nothing and stay (for TensorRT the four triton_ops become plain custom ops of
the same name in ``kvrewrite_export``, `opaque_attention`); observed_attention (the fused pair, a CUDA kernel
choice) is split back into clustered_attention and accumulate_attention first.

Importing this module registers the ``kvrewrite_export::`` ops.
"""
import functools
import operator

import torch
from torch import fx

import kvrewrite.kernels  # noqa: F401  (registers kvrewrite::)
from kvrewrite.passes.utils import all_args  # noqa: F401  (also imported from here by the exporters)
from kvrewrite.state import STATE_FIELDS

MUTATED = ("keys", "values", "bias", "slot_pos", "fill")  # what the in-place ops write, in this order
_T = torch.Tensor
_Out = tuple[_T, _T, _T, _T, _T]
_Out13 = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]  # clustergen_fold's thirteen fields
_Out15 = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]  # ems_compress's fifteen fields


def _clones(*tensors):
    return [t.clone() for t in tensors]


@torch.library.custom_op("kvrewrite_export::cache_append", mutates_args=())
def cache_append(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, k_new: _T, v_new: _T, cache_position: _T,
                 token_valid: _T) -> _Out:
    """kvrewrite::cache_append returning the updated (keys, values, bias, slot_pos, fill)."""
    out = _clones(keys, values, bias, slot_pos, fill)
    torch.ops.kvrewrite.cache_append(*out, k_new, v_new, cache_position, token_valid)
    return tuple(out)


@torch.library.custom_op("kvrewrite_export::evict_to_budget", mutates_args=())
def evict_to_budget(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, n_sink: int) -> _Out:
    """kvrewrite::evict_to_budget returning the updated (keys, values, bias, slot_pos, fill)."""
    out = _clones(keys, values, bias, slot_pos, fill)
    torch.ops.kvrewrite.evict_to_budget(*out, budget, n_sink)
    return tuple(out)


@torch.library.custom_op("kvrewrite_export::chelsea_compress", mutates_args=())
def chelsea_compress(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, n_sink: int, n_recent: int,
                     chunk: int, r_init: float, r_alpha: float, r_steps: int, r_min: float, outlier_mask: int) -> _Out:
    """kvrewrite::chelsea_compress returning the updated (keys, values, bias, slot_pos, fill); the outlier heads
    are a bit mask (bit h: KV head h), since plugin generators and AOTInductor take no (empty) int lists."""
    out = _clones(keys, values, bias, slot_pos, fill)
    heads = outlier_heads(outlier_mask, keys.shape[1])
    torch.ops.kvrewrite.chelsea_compress(*out, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, heads)
    return tuple(out)


@torch.library.custom_op("kvrewrite_export::evict_by_score", mutates_args=())
def evict_by_score(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, score: _T, order: _T,
                   n_recent: int, recent_ratio: float = 0.0, pool: int = 1,
                   reset_score: bool = False) -> tuple[_T, _T, _T, _T, _T, _T, _T]:
    """kvrewrite::evict_by_score returning the updated (keys, values, bias, slot_pos, fill, score, order)."""
    out = _clones(keys, values, bias, slot_pos, fill, score, order)
    torch.ops.kvrewrite.evict_by_score(*out[:5], budget, *out[5:], n_recent, recent_ratio, pool, reset_score)
    return tuple(out)


@torch.library.custom_op("kvrewrite_export::accumulate_attention", mutates_args=())
def accumulate_attention(q: _T, keys: _T, bias: _T, slot_pos: _T, cache_position: _T, score: _T, scale: float,
                         window: int, mode: str, last: int = 0) -> _T:
    """kvrewrite::accumulate_attention returning the updated score."""
    out = score.clone()
    torch.ops.kvrewrite.accumulate_attention(q, keys, bias, slot_pos, cache_position, out, scale, window, mode, last)
    return out


@evict_by_score.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, order, *args, **kwargs):
    return tuple(torch.empty_like(t) for t in (keys, values, bias, slot_pos, fill, score, order))


@accumulate_attention.register_fake
def _(q, keys, bias, slot_pos, cache_position, score, *args, **kwargs):
    return torch.empty_like(score)


@torch.library.custom_op("kvrewrite_export::clustered_attention", mutates_args=())
def clustered_attention(q: _T, keys: _T, values: _T, bias: _T, slot_pos: _T, cache_position: _T, scale: float,
                        window: int, past_only: bool = False, softcap: float = 0.0) -> _T:
    """kvrewrite::clustered_attention as a plain custom op: opaque to every decomposition (the triton_op itself
    may be decomposed into its Triton launch), which a plugin-based backend needs (TensorRT)."""
    return torch.ops.kvrewrite.clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                                   past_only=past_only, softcap=softcap)


@clustered_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False, softcap=0.0):
    return q.new_empty(q.shape)


@torch.library.custom_op("kvrewrite_export::kmeans_cluster", mutates_args=())
def kmeans_cluster(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, centroids: _T,
                   cluster_size: _T, cluster_start: _T, members: _T, n_clusters: _T, cluster_end: _T, n_sink: int,
                   tokens_per_cluster: int, window: int, window_clusters: int, iters: int,
                   seed: int, head_offset: int = 0) -> tuple[_T, _T, _T, _T, _T, _T]:
    """kvrewrite::kmeans_cluster returning the updated (centroids, cluster_size, cluster_start, members, n_clusters,
    cluster_end); the base state is only read."""
    out = _clones(centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)
    torch.ops.kvrewrite.kmeans_cluster(keys, values, bias, slot_pos, fill, budget, *out, n_sink=n_sink,
                                       tokens_per_cluster=tokens_per_cluster, window=window,
                                       window_clusters=window_clusters, iters=iters, seed=seed,
                                       head_offset=head_offset)
    return tuple(out)


@kmeans_cluster.register_fake
def _(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
      cluster_end, *args, **kwargs):
    index = (centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)
    return tuple(torch.empty_like(t) for t in index)


@torch.library.custom_op("kvrewrite_export::select_clusters", mutates_args=())
def select_clusters(q: _T, fill: _T, budget: _T, centroids: _T, cluster_size: _T, cluster_start: _T, members: _T,
                    n_clusters: _T, cluster_end: _T, n_sink: int, max_selected: int, window: int,
                    per_query_head: bool) -> _T:
    """kvrewrite::select_clusters as a plain custom op (opaque to decompositions, like clustered_attention here)."""
    return torch.ops.kvrewrite.select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members,
                                               n_clusters, cluster_end, n_sink=n_sink, max_selected=max_selected,
                                               window=window, per_query_head=per_query_head)


@select_clusters.register_fake
def _(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end, n_sink, max_selected,
      window, per_query_head):
    Hsel = q.shape[1] if per_query_head else centroids.shape[1]
    return q.new_empty((q.shape[0], Hsel, n_sink + max_selected + window), dtype=torch.int32)


@torch.library.custom_op("kvrewrite_export::indexed_attention", mutates_args=())
def indexed_attention(q: _T, keys: _T, values: _T, bias: _T, index: _T, scale: float, softcap: float = 0.0) -> _T:
    """kvrewrite::indexed_attention as a plain custom op (opaque to decompositions, like clustered_attention here)."""
    return torch.ops.kvrewrite.indexed_attention(q, keys, values, bias, index, scale, softcap)


@indexed_attention.register_fake
def _(q, keys, values, bias, index, scale, softcap=0.0):
    return q.new_empty(q.shape)


@torch.library.custom_op("kvrewrite_export::kvmerger_compress", mutates_args=())
def kvmerger_compress(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, score: _T, degree: _T,
                      deficit: _T, recent_ratio: float = 0.34, hh_ratio: float = 0.24, n_sink: int = 0,
                      epsilon: float = 0.75, sigma: float = 5.0, sigma_mode: str = "fixed", values_mode: str = "scale",
                      reading: str = "chain", budget_mode: str = "exact") -> tuple[_T, _T, _T, _T, _T, _T, _T, _T]:
    """kvrewrite::kvmerger_compress returning the updated (keys, values, bias, slot_pos, fill, score, degree,
    deficit); the options are positional here (the in-place op's are keyword-only)."""
    out = _clones(keys, values, bias, slot_pos, fill, score, degree, deficit)
    torch.ops.kvrewrite.kvmerger_compress(*out[:5], budget, *out[5:], recent_ratio=recent_ratio, hh_ratio=hh_ratio,
                                          n_sink=n_sink, epsilon=epsilon, sigma=sigma, sigma_mode=sigma_mode,
                                          values_mode=values_mode, reading=reading, budget_mode=budget_mode)
    return tuple(out)


@kvmerger_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, *args, **kwargs):
    return tuple(torch.empty_like(t) for t in (keys, values, bias, slot_pos, fill, score, degree, deficit))


@torch.library.custom_op("kvrewrite_export::clustergen_fold", mutates_args=())
def clustergen_fold(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, role: _T, rep: _T, count: _T,
                    n_clusters: _T, mu: _T, delta: _T, n_seen: _T, n_forced: _T, n_sink: int, window: int, t: int,
                    value_share: float, cluster_target: float, seed: int, layer: int, head_offset: int = 0) -> _Out13:
    """kvrewrite::clustergen_fold (ClusterGen) returning the updated (keys, values, bias, slot_pos, fill, role, rep,
    count, n_clusters, mu, delta, n_seen, n_forced); budget is only read; the options are positional here (the
    in-place op's are keyword-only)."""
    out = _clones(keys, values, bias, slot_pos, fill, role, rep, count, n_clusters, mu, delta, n_seen, n_forced)
    torch.ops.kvrewrite.clustergen_fold(*out[:5], budget, *out[5:], n_sink=n_sink, window=window, t=t,
                                        value_share=value_share, cluster_target=cluster_target, seed=seed,
                                        layer=layer, head_offset=head_offset)
    return tuple(out)


@clustergen_fold.register_fake
def _(keys, values, bias, slot_pos, fill, budget, *sketch_and_options):
    return tuple(torch.empty_like(t) for t in (keys, values, bias, slot_pos, fill, *sketch_and_options[:8]))


@torch.library.custom_op("kvrewrite_export::kcenter_compress", mutates_args=())
def kcenter_compress(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T,
                     recent_ratio: float = 0.5) -> _Out:
    """kvrewrite::kcenter_compress (clustergen-kcenter) returning the updated (keys, values, bias, slot_pos, fill)."""
    out = _clones(keys, values, bias, slot_pos, fill)
    torch.ops.kvrewrite.kcenter_compress(*out, budget, recent_ratio=recent_ratio)
    return tuple(out)


@torch.library.custom_op("kvrewrite_export::sketch_attention", mutates_args=())
def sketch_attention(q: _T, keys: _T, values: _T, bias: _T, slot_pos: _T, cache_position: _T, role: _T, scale: float,
                     past_only: bool = False, softcap: float = 0.0) -> _T:
    """kvrewrite::sketch_attention (ClusterGen) as a plain custom op (opaque to decompositions, like
    clustered_attention here)."""
    return torch.ops.kvrewrite.sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale=scale,
                                                past_only=past_only, softcap=softcap)


@sketch_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False, softcap=0.0):
    return q.new_empty(q.shape)


# -- EMS (method ems: kvrewrite/kernels/ems_append.py, ems_attention.py, ems_compress.py) ---------------------------
_EMS_APPENDED = ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order", "slot_fill")
_EMS_STATS = ("s_glo", "s_loc_past", "s_loc_cur", "win_count")


@torch.library.custom_op("kvrewrite_export::ems_append", mutates_args=())
def ems_append(keys: _T, bias: _T, fill: _T, k_pre: _T, cache_position: _T, token_valid: _T, entry_start: _T,
               raw_keys: _T, lut: _T, key_scale: _T, token_pos: _T, slot_order: _T,
               slot_fill: _T) -> tuple[_T, _T, _T, _T, _T, _T, _T]:
    """kvrewrite::ems_append returning the updated (entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
    slot_fill); keys, bias and fill are only read."""
    out = _clones(entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill)
    torch.ops.kvrewrite.ems_append(keys, bias, fill, k_pre, cache_position, token_valid, *out)
    return tuple(out)


@ems_append.register_fake
def _(keys, bias, fill, k_pre, cache_position, token_valid, *appended):
    return tuple(torch.empty_like(t) for t in appended)


@torch.library.custom_op("kvrewrite_export::ems_attention", mutates_args=())
def ems_attention(q: _T, keys: _T, values: _T, bias: _T, slot_pos: _T, cache_position: _T, entry_start: _T, lut: _T,
                  key_scale: _T, s_glo: _T, s_loc_past: _T, s_loc_cur: _T, slot_fill: _T, win_count: _T, scale: float,
                  past_only: bool, softcap: float, l_win: int) -> tuple[_T, _T, _T, _T, _T]:
    """kvrewrite::ems_attention returning (out, then the updated s_glo, s_loc_past, s_loc_cur, win_count): the
    attention's output first, as the in-place op returns it; the options are positional here (the in-place op's
    are keyword-only)."""
    stats = _clones(s_glo, s_loc_past, s_loc_cur)
    count = win_count.clone()
    out = torch.ops.kvrewrite.ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut,
                                            key_scale, *stats, slot_fill, count, scale=scale, past_only=past_only,
                                            softcap=softcap, l_win=l_win)
    return out, *stats, count


@ems_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past, s_loc_cur,
      slot_fill, win_count, *options):
    return q.new_empty(q.shape), *(torch.empty_like(t) for t in (s_glo, s_loc_past, s_loc_cur, win_count))


@torch.library.custom_op("kvrewrite_export::ems_compress", mutates_args=())
def ems_compress(keys: _T, values: _T, bias: _T, slot_pos: _T, fill: _T, budget: _T, entry_start: _T, raw_keys: _T,
                 lut: _T, key_scale: _T, token_pos: _T, slot_order: _T, s_glo: _T, s_loc_past: _T, s_loc_cur: _T,
                 slot_fill: _T, l_win: int, pool: int, gamma: float, tau: float) -> _Out15:
    """kvrewrite::ems_compress returning the fifteen fields it writes (every argument but budget, in order); the
    options are positional here (the in-place op's are keyword-only)."""
    out = _clones(keys, values, bias, slot_pos, fill, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
                  s_glo, s_loc_past, s_loc_cur, slot_fill)
    torch.ops.kvrewrite.ems_compress(*out[:5], budget, *out[5:], l_win=l_win, pool=pool, gamma=gamma, tau=tau)
    return tuple(out)


@ems_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, *table_and_options):
    return tuple(torch.empty_like(t) for t in (keys, values, bias, slot_pos, fill, *table_and_options[:10]))


# pure triton_ops -> their plain custom op in kvrewrite_export (functionalize(opaque_attention=True))
OPAQUE = {
    torch.ops.kvrewrite.clustered_attention.default: torch.ops.kvrewrite_export.clustered_attention.default,
    torch.ops.kvrewrite.select_clusters.default: torch.ops.kvrewrite_export.select_clusters.default,
    torch.ops.kvrewrite.indexed_attention.default: torch.ops.kvrewrite_export.indexed_attention.default,
    torch.ops.kvrewrite.sketch_attention.default: torch.ops.kvrewrite_export.sketch_attention.default,
}


def outlier_mask(heads) -> int:
    """The bit mask of a list of KV heads (0 <= h < 62)."""
    if any(not 0 <= h < 62 for h in heads):
        raise ValueError(f"outlier heads {list(heads)} outside 0..61 cannot be passed as a bit mask")
    return sum(1 << h for h in set(heads))


def outlier_heads(mask: int, n_heads: int) -> list:
    """The KV heads (of n_heads) in a bit mask made by outlier_mask."""
    return [h for h in range(n_heads) if mask >> h & 1]


def _fake(keys, values, bias, slot_pos, fill, *args):
    return tuple(torch.empty_like(t) for t in (keys, values, bias, slot_pos, fill))


for _op in (cache_append, evict_to_budget, chelsea_compress, kcenter_compress):
    _op.register_fake(_fake)

# in-place op -> (functional op, positions of the arguments it writes, in the order the functional op returns them)
FUNCTIONAL = {
    torch.ops.kvrewrite.cache_append.default: (torch.ops.kvrewrite_export.cache_append.default, (0, 1, 2, 3, 4)),
    torch.ops.kvrewrite.evict_to_budget.default: (torch.ops.kvrewrite_export.evict_to_budget.default, (0, 1, 2, 3, 4)),
    torch.ops.kvrewrite.chelsea_compress.default: (torch.ops.kvrewrite_export.chelsea_compress.default,
                                                   (0, 1, 2, 3, 4)),
    torch.ops.kvrewrite.evict_by_score.default: (torch.ops.kvrewrite_export.evict_by_score.default,
                                                 (0, 1, 2, 3, 4, 6, 7)),
    torch.ops.kvrewrite.accumulate_attention.default: (torch.ops.kvrewrite_export.accumulate_attention.default, (5,)),
    torch.ops.kvrewrite.kmeans_cluster.default: (torch.ops.kvrewrite_export.kmeans_cluster.default,
                                                 (6, 7, 8, 9, 10, 11)),
    torch.ops.kvrewrite.kvmerger_compress.default: (torch.ops.kvrewrite_export.kvmerger_compress.default,
                                                    (0, 1, 2, 3, 4, 6, 7, 8)),
    torch.ops.kvrewrite.clustergen_fold.default: (torch.ops.kvrewrite_export.clustergen_fold.default,
                                                  (0, 1, 2, 3, 4, *range(6, 14))),
    torch.ops.kvrewrite.kcenter_compress.default: (torch.ops.kvrewrite_export.kcenter_compress.default,
                                                   (0, 1, 2, 3, 4)),
    torch.ops.kvrewrite.ems_append.default: (torch.ops.kvrewrite_export.ems_append.default, tuple(range(6, 13))),
    torch.ops.kvrewrite.ems_attention.default: (torch.ops.kvrewrite_export.ems_attention.default, (9, 10, 11, 13)),
    torch.ops.kvrewrite.ems_compress.default: (torch.ops.kvrewrite_export.ems_compress.default,
                                               (0, 1, 2, 3, 4, *range(6, 16))),
}
# in-place ops that also return a value: their twin returns it first (this many outputs), then the written tensors
RETURNS = {torch.ops.kvrewrite.ems_attention.default: 1}


def written_args(target) -> list:
    """The names of the arguments a kvrewrite op writes (its schema's alias info: Tensor(a!)), [] for any other
    call target."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "kvrewrite":
        return []
    return [a.name for a in target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def unfuse_observed_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with every kvrewrite::observed_attention (passes/fuse_attention_observation.py) split back into the
    kvrewrite::clustered_attention and kvrewrite::accumulate_attention it fuses, in place (functionalize runs it
    on its copy): the ONNX functions and TensorRT plugin descriptions describe those two. The statistics are then
    folded at every step, never deferred (the pending entries stay empty, their state inputs unread): the same
    output, and the same score at every compression; fusing and deferring are a CUDA kernel choice, and a backend
    with native kernels makes its own."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.kvrewrite.observed_attention.default:
            continue
        q, keys, values, bias, slot_pos, cache_position, scale, window, score, _, _, _, mode, last, past_only, _ = \
            all_args(node)
        with gm.graph.inserting_before(node):
            attn = gm.graph.call_function(torch.ops.kvrewrite.clustered_attention.default,
                                          (q, keys, values, bias, slot_pos, cache_position, scale, window),
                                          {"past_only": True} if past_only else {})
            gm.graph.call_function(torch.ops.kvrewrite.accumulate_attention.default,
                                   (q, keys, bias, slot_pos, cache_position, score),
                                   {"scale": scale, "window": window, "stats_mode": mode, "last": last})
        attn.meta.update(node.meta)
        node.replace_all_uses_with(attn)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def gemv_as_linear(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with every kvrewrite::gemv (apply(gemv=True)) turned back into the aten.linear it computes, and every
    kvrewrite::gemv_rms_norm into the add, RMSNorm and linear it fused, and every kvrewrite::gemv_glu into its act,
    mul and linear (the aten ops passes/fuse_glu_into_gemv.py folded), in place: for the targets that bring their
    own matrix kernels (ONNX Runtime, TensorRT) instead of running kvrewrite's Triton ones."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.kvrewrite.gemv.default:
            node.target, node.args, node.kwargs = torch.ops.aten.linear.default, tuple(all_args(node)[:3]), {}
        elif node.op == "call_function" and node.target == torch.ops.kvrewrite.gemv_rms_norm.default:
            _expand_gemv_rms_norm(gm, node)
        elif node.op == "call_function" and node.target == torch.ops.kvrewrite.gemv_glu.default:
            _expand_gemv_glu(gm, node)
    gm.recompile()
    return gm


def _dtype(gm: fx.GraphModule, node: fx.Node):
    """The dtype of a get_attr tensor or of a node's traced value; None where neither is known."""
    if node.op == "get_attr":
        return functools.reduce(getattr, node.target.split("."), gm).dtype
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _expand_gemv_rms_norm(gm: fx.GraphModule, node: fx.Node) -> None:
    """node's aten ops (kernels/gemv_rms_norm.py reference_aten, the ops passes/fuse_rms_norm_into_gemv.py
    replaced) in its place; its getitems' users read them."""
    aten, graph = torch.ops.aten, gm.graph
    x, residual, norm_weight, eps, weight, bias, unit_offset, _ = all_args(node)  # _: constant_weight
    dtypes = [_dtype(gm, t) for t in (weight, norm_weight, x)]  # one dtype: the op checks that they share it
    dtype = next((d for d in dtypes if d is not None), None)
    if dtype is None:
        raise ValueError(f"{node.name}: kvrewrite::gemv_rms_norm's weight, norm weight and x have no known dtype")

    def call(target, *args):
        return graph.call_function(target, args)

    with graph.inserting_before(node):
        h = x if residual is None else call(aten.add.Tensor, x, residual)
        h32 = call(aten.to.dtype, h, torch.float32)
        inv_rms = call(aten.rsqrt.default,
                       call(aten.add.Tensor, call(aten.mean.dim, call(aten.pow.Tensor_Scalar, h32, 2), [-1], True), eps))
        normed = call(aten.mul.Tensor, h32, inv_rms)
        if unit_offset:
            scale = call(aten.add.Tensor, call(aten.to.dtype, norm_weight, torch.float32), 1.0)
            n = call(aten.to.dtype, call(aten.mul.Tensor, normed, scale), dtype)
        else:
            n = call(aten.mul.Tensor, norm_weight, call(aten.to.dtype, normed, dtype))
        y = call(aten.linear.default, n, weight, bias)
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise ValueError(f"{node.name}: kvrewrite::gemv_rms_norm read by {user.name} ({user.target}), not a getitem")
        if user.args[1] == 1 and residual is None and user.users:
            raise ValueError(f"{node.name}: its h (empty without a residual) is read by {list(user.users)}")
        user.replace_all_uses_with(y if user.args[1] == 0 else h)
        graph.erase_node(user)
    graph.erase_node(node)


def _expand_gemv_glu(gm: fx.GraphModule, node: fx.Node) -> None:
    """node as the act, mul and linear it computes (kernels/gemv_glu.py's CPU path, the ops
    passes/fuse_glu_into_gemv.py replaced), in place."""
    a, b, weight, bias, act, _ = all_args(node)  # _: constant_weight
    with gm.graph.inserting_before(node):
        if act == "silu":
            g = gm.graph.call_function(torch.ops.aten.silu.default, (a,))
        else:
            g = gm.graph.call_function(torch.ops.aten.gelu.default, (a,),
                                       {"approximate": "tanh" if act == "gelu_tanh" else "none"})
        x = gm.graph.call_function(torch.ops.aten.mul.Tensor, (g, b))
    node.target, node.args, node.kwargs = torch.ops.aten.linear.default, (x, weight, bias), {}


def functionalize(gm: fx.GraphModule, n_inputs: int = 4, opaque_attention: bool = False) -> fx.GraphModule:
    """A copy of a rewritten graph whose state updates are returned, not applied: output
    (logits, *new_state) in the order of the state inputs (those no op writes come back unchanged).
    `opaque_attention` also swaps the pure triton_ops (kvrewrite::clustered_attention, select_clusters,
    indexed_attention, sketch_attention) for their plain custom ops in kvrewrite_export (OPAQUE).

    Raises ValueError if a state input feeds anything but a kvrewrite op (a view of the state taken
    before an update would read the old value in the functional graph, silently), or if a kvrewrite op that
    writes its inputs has no functional twin in FUNCTIONAL (its writes would be lost, silently)."""
    from kvrewrite.capture import copy_graph_module

    gm = unfuse_observed_attention(copy_graph_module(gm))
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state = placeholders[n_inputs:]
    for p in state:
        bad = [u for u in p.users if not str(u.target).startswith("kvrewrite.")]
        if bad:
            raise ValueError(f"functionalize: state input '{p.name}' feeds non-kvrewrite node(s) "
                             f"{[u.name for u in bad]}; cannot return its update functionally")
    latest = {}  # state placeholder -> node holding its newest value

    def remap(a):
        return fx.node.map_arg(a, lambda n: latest.get(n, n))

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        node.args, node.kwargs = remap(node.args), remap(node.kwargs)
        if opaque_attention and node.target in OPAQUE:
            node.target = OPAQUE[node.target]
            continue
        if node.target not in FUNCTIONAL:
            writes = written_args(node.target)
            if writes:
                name = node.target.name().split(".")[0]
                raise ValueError(
                    f"functionalize: {name} (node '{node.name}') writes its inputs {writes} and has no functional "
                    f"twin: add a kvrewrite_export::{name.split('::')[1]} that returns the updated tensors, and its "
                    f"entry in kvrewrite.export.functional.FUNCTIONAL, to export this graph to ONNX or TensorRT")
            continue
        fn, written = FUNCTIONAL[node.target]
        args = all_args(node)
        if node.target == torch.ops.kvrewrite.chelsea_compress.default:
            args[-1] = outlier_mask(args[-1])
        with graph.inserting_after(node):
            new = graph.call_function(fn, tuple(args))
        lead = RETURNS.get(node.target, 0)
        if len(written) == 1 and not lead:  # a single Tensor return
            latest[_origin(args[written[0]], latest)] = new
        else:
            with graph.inserting_after(new):
                for i in reversed(range(len(written))):
                    item = graph.call_function(operator.getitem, (new, lead + i))
                    latest[_origin(args[written[i]], latest)] = item
                if lead:  # the in-place op's own (single) return: the twin's first output
                    node.replace_all_uses_with(graph.call_function(operator.getitem, (new, 0)))
        graph.erase_node(node)
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = ((out.args[0], *[latest.get(p, p) for p in state]),)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="FunctionalStepGraph")


def _origin(node, latest):
    """The state placeholder whose newest value `node` is."""
    for p, n in latest.items():
        if n is node:
            return p
    return node


def state_names(layers, state_specs=None) -> list:
    """Names of the state inputs/outputs: l<i>_<field>, in the graphs' order (per layer the base fields, then the
    method's own, `state_specs[k]` for the k-th layer: KVRewrittenModel.state_specs)."""
    specs = state_specs or [{}] * len(layers)
    return [f"l{info.index}_{f}" for info, extra in zip(layers, specs) for f in (*STATE_FIELDS, *extra)]
