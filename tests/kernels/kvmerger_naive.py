"""A NAIVE float64 python-loop implementation of the kvrewrite::kvmerger_compress contract (readings "chain" and
"anchor"),
separate code from the op's reference and kernels: the tests' ground truth. Also the tests' state builder.

Counts as the Triton launcher takes them: R = n_recent + floor(recent_ratio * Bt), H = n_heavy + floor(hh_ratio *
Bt), clamped in the order sinks, recent, heavy so that P <= Bt.
"""
import math

import torch

NEG_INF = float("-inf")


def cosine(a, b):
    na, nb = a.norm(), b.norm()
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def naive_kvmerger(keys, values, bias, slot_pos, fill, budget, score, degree, *, n_recent=0, n_heavy=0, n_sink=0,
                   epsilon=0.75, sigma=5.0, sigma_mode="fixed", values_mode="scale", budget_mode="exact",
                   recent_ratio=0.0, hh_ratio=0.0, reading="chain"):
    """Returns (new state dict of CPU tensors, info dict per row: {"fallback": bool, "N": int})."""
    out = {k: t.clone().cpu() for k, t in dict(keys=keys, values=values, bias=bias, slot_pos=slot_pos, fill=fill,
                                                  score=score, degree=degree).items()}
    B, H, C, D = keys.shape
    bt, thr = int(budget[0]), int(budget[1])
    info = {}
    for b in range(B):
        for h in range(H):
            f = int(fill[b, h])
            if f < thr:
                continue
            slots = [s for s in range(min(f, C)) if float(bias[b, h, s]) > NEG_INF]
            N = len(slots)
            K = keys[b, h].double().cpu()
            V = values[b, h].double().cpu()
            sc = score[b, h].double().cpu()
            dg = degree[b, h].cpu()
            prot = [False] * N
            fallback = False
            if N <= bt:
                sets = [[i] for i in range(N)]
            else:
                sinks = min(n_sink, bt)
                recent = min(n_recent + math.floor(recent_ratio * bt), bt - sinks)
                heavy = min(n_heavy + math.floor(hh_ratio * bt), bt - sinks - recent)
                for i in range(N):
                    prot[i] = i < sinks or i >= N - recent
                cand = [i for i in range(sinks, N - recent)]
                cand.sort(key=lambda i: (-float(sc[slots[i]]), i))
                for i in cand[:heavy]:
                    prot[i] = True
                joinable = [i for i in range(N - 1) if not prot[i] and not prot[i + 1]]
                c = {i: cosine(K[slots[i]], K[slots[i + 1]]) for i in joinable}
                J = N - bt
                ranked = sorted(joinable, key=lambda i: (-c[i], i))
                n_ev = J - len(joinable)
                if reading == "anchor":
                    joined, anchor = set(), N - 1
                    for j in range(N - 2, -1, -1):
                        if j in c and cosine(K[slots[anchor]], K[slots[j]]) > epsilon:
                            joined.add(j)
                        else:
                            anchor = j
                    rest = [i for i in ranked if i not in joined]
                    need = max(J - len(joined), 0)
                    joined |= set(rest[:need])
                    fallback = need > len(rest)
                elif J > len(joinable):
                    joined = set(joinable)
                    fallback = True
                elif budget_mode == "exact":
                    joined = set(ranked[:J])
                else:
                    above = {i for i in joinable if c[i] > epsilon}
                    joined = above if len(above) >= J else set(ranked[:J])
                sets = []
                for i in range(N):
                    if i > 0 and (i - 1) in joined:
                        sets[-1].append(i)
                    else:
                        sets.append([i])
                if fallback:
                    merg = [s for s in sets if not prot[s[0]]]
                    merg.sort(key=lambda s: (sum(float(sc[slots[i]]) for i in s), s[0]))
                    gone = {id(s) for s in merg[:n_ev]}
                    sets = [s for s in sets if id(s) not in gone]
            info[(b, h)] = {"fallback": fallback, "N": N, "sets": sets, "prot": prot}
            rows = {k: [] for k in ("keys", "values", "bias", "slot_pos", "score", "degree")}
            for s in sets:
                members = [slots[i] for i in s]
                if len(members) == 1:
                    m = members[0]
                    rows["keys"].append(K[m]); rows["values"].append(V[m])
                    rows["bias"].append(float(bias[b, h, m])); rows["slot_pos"].append(int(slot_pos[b, h, m]))
                    rows["score"].append(float(sc[m])); rows["degree"].append(int(dg[m]))
                    continue
                p = max(members, key=lambda m: (float(sc[m]), -m))
                dist = [float(((K[p] - K[m]) ** 2).sum()) for m in members]
                n = len(members)
                if sigma_mode == "fixed":
                    sg = sigma
                elif sigma_mode == "distance":
                    sg = sum(math.sqrt(x) for x in dist) / (math.sqrt(2) * n)
                else:
                    sg = sigma
                    for _ in range(10):
                        sg = sum(1.0 if sg == 0 else math.exp(-x / (2 * sg * sg)) for x in dist) / (math.sqrt(2) * n)
                g = [1.0 if sg == 0 else math.exp(-x / (2 * sg * sg)) for x in dist]
                d = [int(dg[m]) for m in members]
                z = sum(gi * di for gi, di in zip(g, d))
                w = [gi * di / z for gi, di in zip(g, d)]
                DS = sum(d)
                rows["keys"].append(sum(wi * K[m] for wi, m in zip(w, members)))
                if values_mode == "scale":
                    rows["values"].append(DS * sum(wi * V[m] / di for wi, m, di in zip(w, members, d)))
                    rows["bias"].append(0.0)
                else:
                    rows["values"].append(sum(wi * V[m] for wi, m in zip(w, members)))
                    rows["bias"].append(math.log(DS))
                rows["slot_pos"].append(int(slot_pos[b, h, p]))
                rows["score"].append(sum(float(sc[m]) for m in members))
                rows["degree"].append(DS)
            L = len(sets)
            # freed slots [L, C): empty (bias -inf, score 0, degree 1); keys, values and slot_pos stay as they
            # are (what evict_by_score does: an empty slot is never read)
            out["bias"][b, h] = NEG_INF
            out["score"][b, h] = 0
            out["degree"][b, h] = 1
            if L:
                out["keys"][b, h, :L] = torch.stack(rows["keys"]).to(keys.dtype)
                out["values"][b, h, :L] = torch.stack(rows["values"]).to(values.dtype)
                out["bias"][b, h, :L] = torch.tensor(rows["bias"], dtype=torch.float32)
                out["slot_pos"][b, h, :L] = torch.tensor(rows["slot_pos"])
                out["score"][b, h, :L] = torch.tensor(rows["score"], dtype=torch.float32)
                out["degree"][b, h, :L] = torch.tensor(rows["degree"], dtype=torch.int32)
            out["fill"][b, h] = L
    return out, info


def make_state(B, H, C, D, fills, dtype=torch.float32, seed=0, pad_frac=0.1, left_pad=0, runs=4, run_len=5,
               noise=0.05, device="cpu"):
    """A slot state with planted runs of near-identical keys, random padding slots (and `left_pad` padding slots
    at the front of batch row 0), random degrees 1..3 and distinct scores; slots past fill hold garbage (finite
    bias, keys, scores...) that a due row must reset."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, C, D, generator=g)
    for b in range(B):
        for h in range(H):
            for _ in range(runs):
                s = int(torch.randint(0, max(1, C - run_len), (1,), generator=g))
                base = torch.randn(D, generator=g)
                keys[b, h, s:s + run_len] = base + noise * torch.randn(run_len, D, generator=g)
    values = torch.randn(B, H, C, D, generator=g)
    degree = torch.randint(1, 4, (B, H, C), generator=g, dtype=torch.int32)
    bias = degree.float().log()
    pad = torch.rand(B, H, C, generator=g) < pad_frac
    if left_pad:
        pad[0, :, :left_pad] = True
    bias[pad] = NEG_INF
    score = torch.rand(B, H, C, generator=g) * 10
    slot_pos = torch.arange(C).expand(B, H, C).clone() + 3
    fill = torch.as_tensor(fills, dtype=torch.int64).reshape(B, H)
    state = dict(keys=keys.to(dtype), values=values.to(dtype), bias=bias, slot_pos=slot_pos, fill=fill, score=score,
                 degree=degree)
    return {k: v.to(device) for k, v in state.items()}
