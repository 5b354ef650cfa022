"""Attention fidelity: per layer, how far the compressed cache's attention is from the full cache's.

Same contexts as the nll task (the n Shakespeare tokens before a fixed target). After the prefill
(compressed to B = round(budget * (n + fidelity_steps)) slots), `full` and the method are fed the
same `fidelity_steps` target tokens. Each decode graph runs under a torch.fx.Interpreter that sees
every attention node (role "attention": kvrewrite.clustered_attention; or "observed_attention": the
same attention fused with a method's statistics, whose first eight arguments are the attention's) with its
inputs: the query, the layer's state after this step's append (before any re-compression) and
its output. Per layer and step, with o_full the full cache's output for the full model's query q:

- attn_rel_err: ||attn(q, compressed state) - o_full|| / ||o_full|| over all query heads: the same
  query against the two caches, so it isolates this layer's cache (the headline number);
- attn_rel_err_e2e: the same with the method's own query and output (errors of earlier layers and
  steps included: what the model actually computes);
- topk_recall (ClusterKV, arXiv 2412.03213 Sec. V): with k the number of slots the compressed cache
  holds for the query's KV head, the fraction of the k tokens with the largest true attention
  weight (q over the full cache) that the compressed cache still holds. A slot holds the token at
  its slot_pos: an evicted token is gone; a merged slot (degree n > 1) is credited with its anchor,
  the latest of its tokens (kvrewrite keeps max position of a merge), not the other n - 1 tokens it
  absorbed, whose identity the state does not keep. So for merging methods this is a lower bound
  of "represented", and topk_recall_exact (slots of degree 1 only) says how many top tokens are
  still kept verbatim. For eviction methods both equal ClusterKV's metric. ClusterKV itself keeps
  every token and attends to a selection (an indexed attention): there k is the query head's selected
  slots, held the selection (the paper's metric exactly), and attn_rel_err attends the full model's query
  over the slots the method's own query selected. EMS (role "ems_attention") attends runtime tokens through
  its lookup table: attn_rel_err is kvrewrite::expanded_attention of the full model's query over the layer's
  entries and table; k is the tokens the table holds (live slots, at most gamma * B: the paper's runtime tokens),
  each slot holding the token at its token_pos; topk_recall_exact counts the tokens of unmerged entries only.
  ClusterGen (role "clustergen_attention") attends exact tokens and sketch samples (kvrewrite::sketch_attention):
  attn_rel_err is that op for the full model's query; a sample slot holds the token at its slot_pos (a key
  sample's key and a value sample's key and value are that token's), so recall counts sampled tokens as held
  (k = the distinct tokens held) and topk_recall_exact the exact ones (sinks, window, unfolded).

Each number is averaged over steps (and query heads); the cell's summary averages the layers that
compress (sliding-window layers are exact and left out; their per-layer values are recorded).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import fx, nn

from kvrewrite.eval.nll import TASK as NLL


class _AttentionRecorder(fx.Interpreter):
    """Runs a rewritten decode graph node by node; calls on_attention(layer, args, out) at every attention node."""

    def __init__(self, gm, on_attention):
        super().__init__(gm)
        self.on_attention = on_attention

    def run_node(self, n):
        out = super().run_node(n)
        meta = n.meta.get("kvrewrite") or {}
        if meta.get("role") in ("attention", "observed_attention", "selected_attention", "ems_attention",
                                "clustergen_attention"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if meta["role"] == "selected_attention":  # (q, keys, values, bias, index, scale), softcap=
                self.on_attention(meta["layer"], (*args[:6], kwargs.get("softcap", 0.0)), out)
            elif meta["role"] == "ems_attention":  # (q, keys, values, bias, slot_pos, cpos, entry_start, lut, ...)
                self.on_attention(meta["layer"], EMSArgs(args, kwargs), out)
            elif meta["role"] == "clustergen_attention":  # (q, keys, values, bias, slot_pos, cpos, role)
                self.on_attention(meta["layer"], SketchArgs(args, kwargs), out)
            else:
                self.on_attention(meta["layer"], args[:8], out)
        return out


class EMSArgs:
    """The arguments of a kvrewrite::ems_attention call (its schema's order), as the recorder saw them."""

    def __init__(self, args, kwargs):
        (self.q, self.keys, self.values, self.bias, self.slot_pos, self.cpos, self.entry_start, self.lut,
         self.key_scale, _, _, _, self.slot_fill, _) = args
        self.scale, self.past_only, self.softcap = kwargs["scale"], kwargs["past_only"], kwargs["softcap"]

    def attend(self, q):
        """The layer's expanded attention for the query q (not the method's own)."""
        return torch.ops.kvrewrite.expanded_attention(q, self.keys, self.values, self.bias, self.slot_pos, self.cpos,
                                                      self.entry_start, self.lut, self.key_scale, self.slot_fill,
                                                      self.scale, self.past_only, self.softcap)[0]


class SketchArgs:
    """The arguments of a kvrewrite::sketch_attention call (ClusterGen), as the recorder saw them."""

    def __init__(self, args, kwargs):
        self.q, self.keys, self.values, self.bias, self.slot_pos, self.cpos, self.role = args
        self.scale, self.past_only, self.softcap = kwargs["scale"], kwargs["past_only"], kwargs["softcap"]

    def attend(self, q):
        """The layer's sketched attention for the query q (not the method's own)."""
        return torch.ops.kvrewrite.sketch_attention(q, self.keys, self.values, self.bias, self.slot_pos, self.cpos,
                                                    self.role, scale=self.scale, past_only=self.past_only,
                                                    softcap=self.softcap)


class _Recording(nn.Module):
    def __init__(self, gm, on_attention):
        super().__init__()
        self.gm = gm
        self.on_attention = on_attention

    def forward(self, *args):
        return _AttentionRecorder(self.gm, self.on_attention).run(*args)


@contextmanager
def recording(rw, on_attention):
    """Within the block, rw's decode steps call on_attention(layer, (q, keys, values, bias, slot_pos,
    cache_position, scale, window), out) at each attention node, while the step runs (so before the
    layer's compression op changes the state); at an indexed attention (ClusterKV's selected slots) the
    arguments are (q, keys, values, bias, index, scale, softcap)."""
    saved = rw.decode_graph, rw.decode_compress_graph
    rw.decode_graph, rw.decode_compress_graph = _Recording(saved[0], on_attention), _Recording(saved[1], on_attention)
    try:
        yield
    finally:
        rw.decode_graph, rw.decode_compress_graph = saved


def attention_order(q, keys, bias, slot_pos, cache_position, scale, window) -> torch.Tensor:
    """Positions of the visible slots by decreasing attention weight of q (one decode query), [Hq, n_visible].

    q [1, Hq, 1, D], keys [1, Hkv, C, D], bias / slot_pos [1, Hkv, C]; GQA by index (head h reads h // G).
    """
    Hq, Hkv = q.shape[1], keys.shape[1]
    G = Hq // Hkv
    logits = torch.einsum("hgd,hcd->hgc", q[0, :, 0].float().view(Hkv, G, -1), keys[0].float()) * scale
    logits = logits + bias[0][:, None, :]
    visible = slot_pos[0] <= cache_position[-1]
    if window > 0:
        visible = visible & (slot_pos[0] > cache_position[-1] - window)
    logits = logits.masked_fill(~visible[:, None, :], float("-inf")).reshape(Hq, -1)
    n_visible = int(torch.isfinite(logits).sum(dim=-1).min())
    order = logits.argsort(dim=-1, descending=True, stable=True)[:, :n_visible]
    pos = slot_pos[0].repeat_interleave(G, dim=0)  # [Hq, C]
    return pos.gather(1, order).to(torch.int32)


def _rel_err(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _recall(order, bias, slot_pos, G) -> tuple[float, float]:
    """topk_recall and topk_recall_exact of one layer and step (see the module docstring)."""
    hits = exact_hits = count = 0.0
    for kv in range(bias.shape[1]):
        held = torch.isfinite(bias[0, kv])
        k = int(held.sum())
        anchors = slot_pos[0, kv][held]
        verbatim = slot_pos[0, kv][held & (bias[0, kv] == 0)]
        top = order[kv * G : (kv + 1) * G, :k].long()  # [G, k]
        hits += float(torch.isin(top, anchors).float().mean(dim=1).sum())
        exact_hits += float(torch.isin(top, verbatim).float().mean(dim=1).sum())
        count += G
    return hits / count, exact_hits / count


def _recall_sketch(order, a: SketchArgs, G) -> tuple[float, float]:
    """topk_recall and topk_recall_exact of ClusterGen's cache: k = the distinct tokens its slots hold (a token sampled
    into several slots counts once); exact = the tokens kept exactly (role 0)."""
    hits = exact_hits = count = 0.0
    for kv in range(a.bias.shape[1]):
        held = torch.isfinite(a.bias[0, kv])
        tokens = torch.unique(a.slot_pos[0, kv][held])
        verbatim = a.slot_pos[0, kv][held & (a.role[0, kv] == 0)]
        top = order[kv * G : (kv + 1) * G, : tokens.numel()].long()
        hits += float(torch.isin(top, tokens).float().mean(dim=1).sum())
        exact_hits += float(torch.isin(top, verbatim).float().mean(dim=1).sum())
        count += G
    return hits / count, exact_hits / count


def _recall_selected(order, index, slot_pos, G) -> float:
    """topk_recall of an indexed attention (ClusterKV): per query head, with k its selected slots, the fraction of
    the k tokens of largest true weight among them (every slot holds one token: both recalls are this one)."""
    hits = 0.0
    Hsel = index.shape[1]
    for hq in range(order.shape[0]):
        kv = hq // G
        idx = index[0, hq if Hsel == order.shape[0] else kv].long()
        idx = idx[idx >= 0]
        held = slot_pos[0, kv][idx]
        hits += float(torch.isin(order[hq, :idx.numel()].long(), held).float().mean())
    return hits / order.shape[0]


def _recall_ems(order, a: EMSArgs, token_pos, G) -> tuple[float, float]:
    """topk_recall and topk_recall_exact of an EMS layer: k = the live slots of the KV head (runtime tokens), each
    holding the token at its token_pos; exact: the slots of single-slot (unmerged) entries."""
    hits = exact_hits = count = 0.0
    R = a.lut.shape[2]
    for kv in range(a.bias.shape[1]):
        lut = a.lut[0, kv].long()
        live = (torch.arange(R) < int(a.slot_fill[0, kv])) & (lut >= 0)
        live &= torch.isfinite(a.bias[0, kv][lut.clamp_min(0)])
        per_entry = torch.bincount(lut[live], minlength=a.bias.shape[2])
        single = live & (per_entry[lut.clamp_min(0)] == 1)
        held, verbatim = token_pos[0, kv][live].long(), token_pos[0, kv][single].long()
        top = order[kv * G : (kv + 1) * G, : int(live.sum())].long()
        hits += float(torch.isin(top, held).float().mean(dim=1).sum())
        exact_hits += float(torch.isin(top, verbatim).float().mean(dim=1).sum())
        count += G
    return hits / count, exact_hits / count


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


class FidelityTask:
    name = "fidelity"
    text = NLL.text

    def settings(self, cfg) -> dict:
        return {"fidelity_steps": cfg.fidelity_steps, "samples": cfg.samples}

    def gamma(self, cfg) -> int:
        return cfg.fidelity_steps

    def contexts(self, tokenizer, text, cfg) -> list:
        return NLL.contexts(tokenizer, text, cfg)  # same prompts (same keys): one prefill serves both tasks

    @torch.no_grad()
    def reference(self, full_rw, ctx, start, cfg):
        """Per step, per layer: the full model's query, attention output, and slot order by true weight."""
        steps = []

        def on_attention(layer, args, out):
            q, keys, _, bias, slot_pos, cpos, scale, window = args
            # slot_pos: the full cache's positions; ClusterKV keeps every slot where full does, so its index reads them
            steps[-1][layer] = {"q": q.clone(), "out": out.clone(), "slot_pos": slot_pos.clone(),
                                "order": attention_order(q, keys, bias, slot_pos, cpos, scale, window)}

        self._decode(full_rw, ctx, start, cfg, steps, on_attention)
        return None, steps

    @torch.no_grad()
    def run(self, rw, ctx, start, ref, cfg) -> dict:
        layers = {info.index: info for info in rw.layers}
        per = {i: {"attn_rel_err": [], "attn_rel_err_e2e": [], "topk_recall": [], "topk_recall_exact": []}
               for i in layers}
        steps = []

        def on_attention(layer, args, out):
            r = ref[len(steps) - 1][layer]
            if isinstance(args, EMSArgs):  # the expanded attention over the entries and the lookup table
                iso = args.attend(r["q"])
                recall, exact = _recall_ems(r["order"], args, rw.layer_state(layer)["token_pos"],
                                            args.q.shape[1] // args.keys.shape[1])
            elif isinstance(args, SketchArgs):  # ClusterGen: every slot (exact token or sample) holds its slot_pos
                iso = args.attend(r["q"])
                recall, exact = _recall_sketch(r["order"], args, args.q.shape[1] // args.keys.shape[1])
            elif len(args) == 7:  # ClusterKV: the slots its selection indexed (chosen with the method's own query)
                q, keys, values, bias, index, scale, softcap = args
                iso = torch.ops.kvrewrite.indexed_attention(r["q"], keys, values, bias, index, scale, softcap)
                slot_pos = r["slot_pos"]
                recall = exact = _recall_selected(r["order"], index, slot_pos, q.shape[1] // keys.shape[1])
            else:
                q, keys, values, bias, slot_pos, cpos, scale, window = args
                iso = torch.ops.kvrewrite.clustered_attention(r["q"], keys, values, bias, slot_pos, cpos, scale,
                                                              window)
                recall, exact = _recall(r["order"], bias, slot_pos, q.shape[1] // keys.shape[1])
            per[layer]["attn_rel_err"].append(_rel_err(iso, r["out"]))
            per[layer]["attn_rel_err_e2e"].append(_rel_err(out, r["out"]))
            per[layer]["topk_recall"].append(recall)
            per[layer]["topk_recall_exact"].append(exact)

        self._decode(rw, ctx, start, cfg, steps, on_attention)
        names = ("attn_rel_err", "attn_rel_err_e2e", "topk_recall", "topk_recall_exact")
        per_layer = {k: [_mean(per[i][k]) for i in sorted(layers)] for k in names}
        compressed = [i for i in sorted(layers) if not layers[i].window]
        out = {k: _mean([per_layer[k][i] for i in compressed]) for k in names}
        out["per_layer"] = per_layer
        out["sliding_layers"] = [i for i in sorted(layers) if layers[i].window]
        return out

    def _decode(self, rw, ctx, start, cfg, steps, on_attention):
        tokens = ctx.data["target"][0, : cfg.fidelity_steps]
        start(rw, cfg.fidelity_steps)
        with recording(rw, on_attention):
            for tok in tokens:
                steps.append({})
                rw.decode_step(tok.view(1))


TASK = FidelityTask()
