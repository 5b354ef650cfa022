"""A decode sequence over a slot state, for kvrewrite::observed_attention's deferred statistics: the state holds a
prompt's tokens (some padding, some merged slots), then each step appends one token as cache_append does and
attends. The same steps run through observed_attention (statistics deferred except where told) and through
clustered_attention + accumulate_attention (folded at every step); after every step that does not defer, both
scores agree."""
import math

import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.observed_attention import pending_entries


def prompt_state(B, Hq, Hkv, C, D, n_prompt, dtype, seed, device="cpu"):
    """(state dict, q generator). Slots [0, n_prompt) hold positions 0..n_prompt-1 (a few padding slots with bias
    -inf, degrees 1..3), the rest are empty; score random >= 0 (what earlier steps left); nothing pending."""
    g = torch.Generator().manual_seed(seed)
    G = Hq // Hkv
    P = pending_entries(G)
    keys = torch.zeros(B, Hkv, C, D)
    keys[:, :, :n_prompt] = torch.randn(B, Hkv, n_prompt, D, generator=g)
    values = torch.zeros(B, Hkv, C, D)
    values[:, :, :n_prompt] = torch.randn(B, Hkv, n_prompt, D, generator=g)
    bias = torch.full((B, Hkv, C), -math.inf)
    bias[:, :, :n_prompt] = torch.randint(1, 4, (B, Hkv, n_prompt), generator=g).float().log()
    bias[:, :, :n_prompt][torch.rand(B, Hkv, n_prompt, generator=g) < 0.1] = -math.inf
    slot_pos = torch.zeros(B, Hkv, C, dtype=torch.int64)
    slot_pos[:, :, :n_prompt] = torch.arange(n_prompt)
    state = dict(keys=keys.to(dtype), values=values.to(dtype), bias=bias, slot_pos=slot_pos,
                 fill=torch.full((B, Hkv), n_prompt, dtype=torch.int64),
                 score=torch.rand(B, Hkv, C, generator=g) * (bias > -math.inf),
                 pending_q=torch.zeros(B, Hkv, P, G, D), pending_lse=torch.full((B, Hkv, P, G), math.inf))
    return {k: v.to(device) for k, v in state.items()}, g


def append(state, g, position, dtype):
    """One decode token for every row, at slot fill (cache_append's reference), fill += 1."""
    B, Hkv, _, D = state["keys"].shape
    k, v = torch.randn(2, B, Hkv, 1, D, generator=g).to(dtype).to(state["keys"].device)
    cp = torch.tensor([position], device=state["keys"].device)
    valid = torch.ones(B, 1, dtype=torch.bool, device=cp.device)
    torch.ops.kvrewrite.cache_append(state["keys"], state["values"], state["bias"], state["slot_pos"], state["fill"],
                                     k, v, cp, valid)
    return cp


def run(state, g, steps, n_prompt, Hq, dtype, scale, mode, last, past_only, defer_at, fused, launch=None):
    """`steps` decode steps; returns the outputs. fused: observed_attention (or `launch`, its _launch for
    Triton's interpreter) with defer=defer_at(step); else the two ops."""
    B, Hkv, _, D = state["keys"].shape
    outs = []
    for step in range(steps):
        cp = append(state, g, n_prompt + step, dtype)
        q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(cp.device)
        s = state
        base = (q, s["keys"], s["values"], s["bias"], s["slot_pos"], cp, scale, 0)
        if fused:
            fn = launch or torch.ops.kvrewrite.observed_attention
            outs.append(fn(*base, s["score"], s["pending_q"], s["pending_lse"], s["fill"], mode, last, past_only,
                           defer_at(step)))
        else:
            outs.append(torch.ops.kvrewrite.clustered_attention(*base, past_only))
            torch.ops.kvrewrite.accumulate_attention(q, s["keys"], s["bias"], s["slot_pos"], cp, s["score"], scale, 0,
                                                     mode, last)
    return outs
