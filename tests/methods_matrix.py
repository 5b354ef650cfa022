"""Every compression method with small settings, ordered from mild to aggressive.

Each entry is one `kvrewrite.apply(model, method=entry["name"], **entry["kwargs"])`. The settings fit
the tiny test models (tests/families.py) with a prompt of ~26 tokens and 8 new tokens: budgets are
fractions of n + Γ, so e.g. chelsea at 0.3 keeps round(0.3 * 34) = 10 slots per KV head, enough for
its n_sink + n_recent + 2 minimum.
"""
METHODS_MATRIX = [
    {"name": "full", "kwargs": {}},
    {"name": "streamingllm", "kwargs": {"budget": 0.5, "n_sink": 4, "interval": 4}},
    {"name": "chelsea", "kwargs": {"budget": 0.5, "n_sink": 2, "n_recent": 4, "chunk": 8, "interval": 4}},
    {"name": "chelsea", "kwargs": {"budget": 0.3, "n_sink": 2, "n_recent": 4, "chunk": 4, "interval": 2,
                                   "r_init": 0.5, "r_alpha": 0.1, "r_steps": 2, "r_min": 0.25}},
    {"name": "streamingllm", "kwargs": {"budget": 0.2, "n_sink": 2, "interval": 2}},
]
