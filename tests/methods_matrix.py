"""Every compression method with small settings, ordered from mild to aggressive.

Each entry is one `kvrewrite.apply(model, method=entry["name"], **entry["kwargs"])`. The settings fit
the tiny test models (tests/families.py) with a prompt of ~26 tokens and 8 new tokens: a float budget
is a fraction of n + Γ, so e.g. chelsea at 0.3 keeps round(0.3 * 34) = 10 slots per KV head, enough for
its n_sink + n_recent + 2 minimum; an int budget counts slots (h2o at 12 keeps 12, about 0.35 of 34).
The order compares budgets as fractions of n + Γ = 34 (tests/methods/test_matrix.py).
"""
N_TOKENS = 34  # the ~26-token prompt + 8 new tokens the settings are sized for

METHODS_MATRIX = [
    {"name": "full", "kwargs": {}},
    {"name": "snapkv", "kwargs": {"budget": 0.6, "window": 4, "kernel": 3, "interval": 4}},
    {"name": "streamingllm", "kwargs": {"budget": 0.5, "n_sink": 4, "interval": 4}},
    {"name": "chelsea", "kwargs": {"budget": 0.5, "n_sink": 2, "n_recent": 4, "chunk": 8, "interval": 4}},
    {"name": "kvmerger", "kwargs": {"budget": 0.4, "interval": 4}},
    {"name": "ems", "kwargs": {"budget": 0.4, "window": 4, "kernel": 3, "interval": 4}},
    {"name": "clustergen", "kwargs": {"budget": 0.4, "n_sink": 2, "window": 4, "t": 2, "interval": 4}},
    {"name": "clustergen-kcenter", "kwargs": {"budget": 0.4, "interval": 4}},
    {"name": "h2o", "kwargs": {"budget": 12, "interval": 4}},
    {"name": "chelsea", "kwargs": {"budget": 0.3, "n_sink": 2, "n_recent": 4, "chunk": 4, "interval": 2,
                                   "r_init": 0.5, "r_alpha": 0.1, "r_steps": 2, "r_min": 0.25}},
    {"name": "clusterkv", "kwargs": {"budget": 10, "n_sink": 2, "interval": 4, "tokens_per_cluster": 4,
                                     "window_clusters": 2, "iters": 3, "dense_layers": 1}},
    {"name": "snapkv", "kwargs": {"budget": 8, "window": 2, "kernel": 7, "interval": 2}},
    {"name": "streamingllm", "kwargs": {"budget": 0.2, "n_sink": 2, "interval": 2}},
    {"name": "h2o", "kwargs": {"budget": 0.2, "recent_ratio": 0.25, "interval": 1}},
]


def budget_fraction(entry) -> float:
    """The entry's budget as a fraction of N_TOKENS (an int budget counts slots)."""
    b = entry["kwargs"].get("budget", 1.0)
    return b / N_TOKENS if isinstance(b, int) else b
