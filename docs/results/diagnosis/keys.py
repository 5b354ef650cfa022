"""Chelsea on real keys (docs/results-notes.md): key similarity (the paper's cos >= 0.8 statistic), and an
independent float64 re-implementation of the paper's algorithm compared with kvrewrite's op at budget 0.2.

    PYTHONPATH=. python docs/results/diagnosis/keys.py smollm2-135m|qwen2.5-0.5b
"""
import sys, time, json
import torch, torch.nn.functional as F
from kvrewrite.assets import load_model, load_text
from kvrewrite.kernels.chelsea_compress import chelsea_rows

name = sys.argv[1]
samples = [(0, 2), (1, 2)] if name == "smollm2-135m" else [(0, 1)]
model, tok = load_model(name)
text = load_text("shakespeare")
T0 = time.time()
out = {"model": name}

def naive(K, V, target, n_sink=16, n_recent=64, chunk=256, r_init=.35, r_alpha=.1, r_steps=2, r_min=.1):
    """Paper's Alg. from the note's pseudocode, written independently: float64, explicit member lists."""
    toks = [dict(k=K[i].double(), v=V[i].double(), n=1.0, mem=[i]) for i in range(K.shape[0])]
    rounds = []
    i = 0
    while len(toks) > target:
        L = len(toks); mid = toks[n_sink:L - n_recent]; M = len(mid)
        r = max(r_init - r_alpha * min(r_steps, i), r_min)
        n_merge = min(max(1, int(r * M + 1e-9)), L - target)
        edges = []
        for c0 in range(0, M, chunk):
            ids = list(range(c0, min(c0 + chunk, M)))
            A, B = ids[0::2], ids[1::2]
            if not B: continue
            kb = F.normalize(torch.stack([mid[b]["k"] for b in B]), dim=-1)
            for a in A:
                s = kb @ F.normalize(mid[a]["k"], dim=0)
                j = int(s.argmax()); edges.append((float(s[j]), a, B[j]))
        edges.sort(key=lambda e: -e[0]); kept = edges[:n_merge]
        rounds.append((r, n_merge, kept[-1][0] if kept else None, sum(e[0] for e in kept) / max(len(kept), 1)))
        gone = set()
        for s, a, b in kept:
            ta, tb = mid[a], mid[b]
            tb["k"] = (tb["k"] * tb["n"] + ta["k"] * ta["n"]) / (tb["n"] + ta["n"])
            tb["v"] = (tb["v"] * tb["n"] + ta["v"] * ta["n"]) / (tb["n"] + ta["n"])
            tb["n"] += ta["n"]; tb["mem"] += ta["mem"]; gone.add(a)
        toks = toks[:n_sink] + [t for j, t in enumerate(mid) if j not in gone] + toks[L - n_recent:]
        i += 1
    return toks, rounds

from kvrewrite.eval.nll import text_sample
class _S: pass
ctx, _ = text_sample(tok, text, 1024, samples[0][0], samples[0][1], 256)
with torch.no_grad():
    pkv = model(ctx, use_cache=True).past_key_values
snap = _S(); snap.state = [{"keys": l.keys, "values": l.values} for l in pkv.layers]
# 1. key similarity (the paper's calibration statistic: share of A slots whose best in-chunk B has cos >= 0.8)
per_layer = []
for l, st in enumerate(snap.state):
    Kall = st["keys"][0].float()  # [H, n, D]
    H, n, D = Kall.shape
    mid = F.normalize(Kall[:, 16:n - 64], dim=-1)
    fr, med = [], []
    for h in range(H):
        best = []
        for c0 in range(0, mid.shape[1], 256):
            ch = mid[h, c0:c0 + 256]; a, b = ch[0::2], ch[1::2]
            best.append((a @ b.T).max(dim=1).values)
        best = torch.cat(best); fr.append(float((best >= 0.8).float().mean())); med.append(float(best.median()))
    per_layer.append((fr, med))
allfr = [x for fr, _ in per_layer for x in fr]
out["cos08_share_mean"] = sum(allfr) / len(allfr)
out["cos08_share_by_layer"] = [round(sum(fr) / len(fr), 3) for fr, _ in per_layer]
out["best_cos_median_by_layer"] = [round(sum(m) / len(m), 3) for _, m in per_layer]
out["heads_below_half"] = sum(x < 0.5 for x in allfr) / len(allfr)
print(json.dumps({k: out[k] for k in ("cos08_share_mean", "heads_below_half")}), flush=True)
print("cos>=0.8 share by layer", out["cos08_share_by_layer"], flush=True)
print("median best cos by layer", out["best_cos_median_by_layer"], flush=True)

# 2. independent re-implementation vs the op's reference, on real keys, budget 0.2 of n + 256
target = round(0.2 * (1024 + 256))
chk = []
for l in (0, len(snap.state) // 2, len(snap.state) - 1):
    K = snap.state[l]["keys"][0].float(); V = snap.state[l]["values"][0].float(); H = K.shape[0]
    n0 = torch.ones(H, K.shape[1]); pos = torch.arange(K.shape[1]).expand(H, -1).clone()
    Ko, Vo, no, po = chelsea_rows(K, V, n0, pos, target, 16, 64, 256, .35, .1, 2, .1)
    for h in range(H):
        toks, rounds = naive(K[h], V[h], target)
        kn = torch.stack([t["k"] for t in toks]).float(); vn = torch.stack([t["v"] for t in toks]).float()
        nn_ = torch.tensor([t["n"] for t in toks])
        # how well one centroid stands for its members: mean cos(member key, centroid), over merged tokens
        spread = [float(F.cosine_similarity(K[h, t["mem"]], t["k"].float()[None], dim=-1).mean()) for t in toks if t["n"] > 1]
        chk.append(dict(layer=l, head=h, slots=len(toks), dK=float((kn - Ko[h]).abs().max()), dV=float((vn - Vo[h]).abs().max()),
                        dn=float((nn_ - no[h]).abs().max()), rounds=len(rounds),
                        last_round_min_cos=round(rounds[-1][2], 3), first_round_min_cos=round(rounds[0][2], 3),
                        member_cos=round(sum(spread) / len(spread), 3), max_deg=int(nn_.max())))
        print(chk[-1], flush=True)
out["reimpl_check"] = chk
print(f"stats done {time.time() - T0:.0f}s", flush=True)

print(json.dumps(out))
