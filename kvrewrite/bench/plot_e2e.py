"""Plots of a `kvrewrite bench` JSON: ms/token vs context (batch 1), decode throughput vs batch, memory.

    python -m kvrewrite.bench.plot_e2e docs/bench/e2e_h100.json [--out e2e_h100.png]
"""
import argparse
import json
from pathlib import Path


def _label(r) -> str:
    """The row's system, with what its kvrewrite flags changed: decoded through Inductor, fused projections, GEMV."""
    extra = [name for name, on in (("inductor", r.get("kv_compile") == "inductor"),
                                   ("fused", r.get("fuse_projections")), ("gemv", r.get("gemv"))) if on]
    return r["system"] + (f" ({', '.join(extra)})" if extra else "")


def _ok(rows):
    """Measured rows, each labelled by _label."""
    return [dict(r, system=_label(r)) for r in rows if "ms_per_token" in r]


def plot_e2e(doc: dict, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, env = _ok(doc["rows"]), doc["env"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, (ax_t, ax_b, ax_m) = plt.subplots(1, 3, figsize=(16, 4.6))
    for s in systems:
        b1 = sorted((r for r in rows if r["system"] == s and r["batch"] == 1), key=lambda r: r["context"])
        if b1:
            line, = ax_t.plot([r["context"] for r in b1], [r["ms_per_token"] for r in b1], "o-", label=s)
            ax_t.plot([r["context"] for r in b1], [r["floor_ms"] for r in b1], ":", color=line.get_color(), lw=1)
            ax_m.plot([r["context"] for r in b1], [r.get("peak_gib", float("nan")) for r in b1], "o-",
                      color=line.get_color(), label=f"{s} peak (B=1)")
    contexts = sorted({r["context"] for r in rows})
    markers = "osd^v"
    for i, n in enumerate(contexts):
        for s in systems:
            sel = sorted((r for r in rows if r["system"] == s and r["context"] == n), key=lambda r: r["batch"])
            if len(sel) > 1 or (sel and sel[0]["batch"] > 1):
                ax_b.plot([r["batch"] for r in sel], [r["tok_per_s"] for r in sel], markers[i % 5] + "-",
                          label=f"{s} n={n // 1024}k")
    ax_t.set(xscale="log", yscale="log", xlabel="context n (tokens)", ylabel="ms per output token (B=1)",
             title="decode time per token (dotted: roofline floor)")
    ax_b.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s", title="throughput vs batch")
    ax_m.set(xscale="log", xlabel="context n (tokens)", ylabel="peak GPU memory (GiB)", title="memory")
    for ax in (ax_t, ax_b, ax_m):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no rows of this kind in the run", transform=ax.transAxes, ha="center", fontsize=9)
    fig.suptitle(f"{doc['config']['model']} random bf16 | {env.get('gpu')} | torch {env['torch']} | transformers "
                 f"{env['transformers']} | triton {env.get('triton', '-')} | {env['git_sha'][:10]} | copy "
                 f"{doc['copy_gbps']:.0f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def markdown_table(doc: dict) -> str:
    """One markdown row per bench row (skipped and failed rows say why)."""
    head = ("| system | n | B | ms/token | tok/s | prefill s (x dense) | peak GiB | KV GiB | floor ms | x floor | "
            "plain / compress step ms | decode |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["rows"]:
        cells = [_label(r), f"{r['context'] // 1024}k", str(r["batch"])]
        if "ms_per_token" not in r:
            lines.append("| " + " | ".join(cells + [r.get("skipped") or r.get("error", "?")] + [""] * 8) + " |")
            continue
        pre = f"{r['prefill_s']:.2f}" if "prefill_s" in r else "-"
        if "prefill_vs_dense" in r:
            pre += f" ({r['prefill_vs_dense']:.2f}x)"
        comp = "-" if r["ms_compress_step_mean"] != r["ms_compress_step_mean"] else f"{r['ms_compress_step_mean']:.1f}"
        decode = r.get("kv_compile", "compiled" if r["system"] == "hf-compiled" else "eager")
        cells += [f"{r['ms_per_token']:.2f}", f"{r['tok_per_s']:.0f}", pre, f"{r.get('peak_gib', float('nan')):.1f}",
                  f"{r['kv_bytes'] / 2**30:.2f}", f"{r['floor_ms']:.2f}", f"{r['ratio_to_floor']:.2f}",
                  f"{r['ms_plain_step_median']:.2f} / {comp}", decode]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", action="store_true", help="print the rows as a markdown table, draw nothing")
    args = parser.parse_args()
    doc = json.loads(args.json.read_text())
    if args.markdown:
        print(markdown_table(doc))
        return
    out = args.out or args.json.with_suffix(".png")
    plot_e2e(doc, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
