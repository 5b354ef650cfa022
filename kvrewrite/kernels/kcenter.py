"""Greedy k-center (farthest-point traversal; Gonzalez 1985, a 2-approximation of the k-center optimum).

Shared by ClusterGen's δ calibration (kvrewrite::clustergen_fold, docs/contracts/clustergen.md §1.6) and
clustergen-kcenter's compression op (kvrewrite::kcenter_compress, §1.13 / §3.3). Not an op itself.

Rule (per row n): the first centre is the first valid point (lowest index); each next centre is the valid point,
not yet chosen, farthest from the chosen ones (the distance to its nearest chosen centre), ties to the lowest
index; stop after k_n centres or when every valid point is chosen. radius_n = the largest distance of a valid
point to its nearest chosen centre (0 when every valid point is chosen or none is valid; inf when k_n = 0 and a
point is valid).

Distances are Euclidean, computed in fp32 as sum((x - c)^2) (no ||x||^2 - 2 x.c + ||c||^2 expansion: exact
zeros for duplicates, no cancellation); comparisons are on squared distances, radius = sqrt(max) in fp32.
Static-shape tensor code: a loop over a static number of steps, vectorised over rows, no host reads,
deterministic (argmax / argmin return the first extremum).
"""
import torch

NEG_INF = float("-inf")


def greedy_kcenter(points: torch.Tensor, valid: torch.Tensor, k, *, k_max: int | None = None):
    """Greedy k-center of each row's valid points.

    Args:
        points: [N, P, D] floating (any dtype; distances in fp32).
        valid: [N, P] bool, the points of each row that take part.
        k: int, or an int64 tensor [N] (per-row number of centres, read on the device).
        k_max: static bound on the steps (columns of `order`) when k is a tensor: default P. Centres past
            k_max are not chosen, so pass a bound >= max(k) (e.g. the state's capacity). Ignored for an int k.

    Returns:
        order: [N, K] int64, K = min(k, P) for an int k, min(k_max, P) for a tensor: the chosen point indices in
            the order chosen; -1 past the row's min(k_n, number of valid points).
        radius: [N] fp32, max over valid points of the distance to the nearest chosen centre.
    """
    if points.dim() != 3 or not points.dtype.is_floating_point:
        raise ValueError(f"greedy_kcenter: points must be a floating [N, P, D] tensor, got {points.dtype} "
                         f"{list(points.shape)}")
    N, P, D = points.shape
    if tuple(valid.shape) != (N, P) or valid.dtype != torch.bool:
        raise ValueError(f"greedy_kcenter: valid must be torch.bool [N, P] = {[N, P]}, got {valid.dtype} "
                         f"{list(valid.shape)}")
    dev = points.device
    if isinstance(k, torch.Tensor):
        if tuple(k.shape) != (N,) or k.dtype != torch.int64:
            raise ValueError(f"greedy_kcenter: a tensor k must be torch.int64 [N] = {[N]}, got {k.dtype} "
                             f"{list(k.shape)}")
        steps = P if k_max is None else k_max
        kk = k.to(dev)
    else:
        steps = int(k)
        kk = torch.full((N,), steps, dtype=torch.int64, device=dev)
    if steps < 0:
        raise ValueError(f"greedy_kcenter: k (or k_max) must be >= 0, got {steps}")
    steps = min(steps, P)
    x = points.float()
    order = torch.full((N, steps), -1, dtype=torch.int64, device=dev)
    d2 = torch.full((N, P), float("inf"), device=dev)   # squared distance to the nearest chosen centre
    chosen = torch.zeros(N, P, dtype=torch.bool, device=dev)
    rows = torch.arange(N, device=dev)
    for i in range(steps):
        cand = valid & ~chosen
        # before the first centre every candidate has d2 = inf: argmax gives the first valid point
        score = torch.where(cand, d2, NEG_INF)
        c = score.argmax(-1)
        active = cand.any(-1) & (kk > i)
        order[:, i] = torch.where(active, c, -1)
        chosen[rows, c] |= active
        dc = ((x - x[rows, c][:, None, :]) ** 2).sum(-1)
        d2 = torch.where(active[:, None], torch.minimum(d2, dc), d2)
    far = torch.where(valid & ~chosen, d2, 0.0).amax(-1) if P > 0 else torch.zeros(N, device=dev)
    return order, far.sqrt()
