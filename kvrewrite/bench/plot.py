"""Draw a benchmark's JSON (a list of {config, result, env}) without re-running it.

    python -m kvrewrite.bench.plot attention.json [--out attention.png]

attention.json (kvrewrite.bench.attention): left, achieved GB/s of the Triton op and of SDPA against C, one
line per B, with the measured copy bandwidth as the ceiling; right, SDPA time / Triton time (> 1: faster),
with the ratio the op would reach moving its bytes (SDPA's plus the bias) at SDPA's GB/s (dotted).
"""
import argparse
import json
from pathlib import Path


def env_label(env) -> str:
    """A run's machine and versions, for a plot title: GPU, torch, triton, commit."""
    return f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['git_sha'][:10]}"


def plot_attention(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r["result"].get("skipped")]
    env = rows[0]["env"]
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for B in sorted({r["config"]["B"] for r in rows}):
        sel = sorted((r for r in rows if r["config"]["B"] == B), key=lambda r: r["config"]["C"])
        C = [r["config"]["C"] for r in sel]
        res = [r["result"] for r in sel]
        line, = ax_bw.plot(C, [x["triton_gbps"] for x in res], "o-", label=f"Triton op, B={B}")
        # SDPA's own bytes: K, V, q and the output (no bias, no positions; older JSONs: 12 bytes per slot fewer)
        sdpa_bytes = [x.get("sdpa_bytes") or x["bytes_moved"] - 12 * B * r["config"]["Hkv"] * r["config"]["C"]
                      for x, r in zip(res, sel)]
        ax_bw.plot(C, [n / x["sdpa_us"] / 1e3 for n, x in zip(sdpa_bytes, res)], "x--", color=line.get_color(),
                   label=f"SDPA (best backend, its own bytes), B={B}")
        line, = ax_ratio.plot(C, [x["sdpa_over_triton"] for x in res], "o-", label=f"B={B}")
        # the ratio a kernel moving its bytes at SDPA's GB/s would reach: below 1 by the bias's bytes
        ax_ratio.plot(C, [n / x["bytes_moved"] for n, x in zip(sdpa_bytes, res)], ":", color=line.get_color(),
                      label=f"at SDPA's GB/s (SDPA's bytes / ours), B={B}")
    copy = rows[0]["result"]["copy_gbps"]
    ax_bw.axhline(copy, color="k", lw=1, label=f"D2D copy {copy:.0f} GB/s")
    ax_bw.axhline(0.8 * copy, color="k", lw=1, ls=":", label="80% of copy")
    ax_ratio.axhline(1.0, color="k", lw=1)
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("C (slots)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    c = rows[0]["config"]
    ax_bw.set_ylabel("GB/s (bytes each must move / time)")
    ax_ratio.set_ylabel("SDPA time / Triton time")
    fig.suptitle(f"decode attention, Hq {c['Hq']} Hkv {c['Hkv']} D {c['D']} {c['dtype']} T {c['T']} | "
                 f"{env_label(env)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="image file (default: the JSON's name, .png)")
    args = parser.parse_args()
    rows = json.loads(args.json.read_text())
    out = args.out or args.json.with_suffix(".png")
    plot_attention(rows, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
