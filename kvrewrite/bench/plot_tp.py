"""Plot of tensor-parallel bench runs (`kvrewrite bench --tp N` JSONs next to their tp=1 baselines): per row, the
time per token against its floor, and the decode throughput at every batch measured.

    python -m kvrewrite.bench.plot_tp docs/bench/tp_h200x2_*.json --out docs/bench/tp_h200x2.png
"""
import argparse
import json
from pathlib import Path


def _rows(paths) -> tuple[list, dict]:
    """(measured rows of every JSON, each labelled by model, system, batch, tp and decode path, the first JSON's
    env); repeated runs of a label are kept apart (the plot shows their range)."""
    out, env = [], None
    for p in paths:
        doc = json.loads(Path(p).read_text())
        env = env or doc["env"]
        tp = doc["env"].get("tp", 1)
        for r in doc["rows"]:
            if "ms_per_token" not in r:
                continue
            decode = "Inductor" if r.get("kv_compile") == "inductor" else "CUDA graphs"
            model = r["model"].replace("llama-3.1-", "").replace("llama-3-", "")
            if tp > 1 and "tp_all_reduce" in r:  # the sum over ranks (apply's tp_all_reduce); older rows: NCCL
                decode += ", one-shot" if r["tp_all_reduce"] == "one_shot" else ", NCCL"
            out.append(dict(r, tp=tp, label=f"{model} {r['system']}\nB={r['batch']} tp={tp}\n{decode}"))
    return out, env


def plot_tp(paths, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, env = _rows(paths)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, (ax_t, ax_x) = plt.subplots(2, 1, figsize=(max(10, 1.15 * len(labels)), 9))
    for i, lab in enumerate(labels):
        same = [r for r in rows if r["label"] == lab]
        ms = [r["ms_per_token"] for r in same]
        floor = min(r["floor_ms"] for r in same)
        color = "C1" if same[0]["tp"] > 1 else "C0"
        ax_t.bar(i, max(ms), color=color, alpha=0.35)
        ax_t.bar(i, min(ms), color=color)
        ax_t.plot([i - 0.4, i + 0.4], [floor, floor], "k-", lw=1.5)
        ax_t.text(i, max(ms), f"{min(ms):.2f}-{max(ms):.2f}\nx{min(ms) / floor:.2f}" if len(ms) > 1
                  else f"{ms[0]:.2f}\nx{ms[0] / floor:.2f}", ha="center", va="bottom", fontsize=7)
        tps = [r["tok_per_s"] for r in same]
        ax_x.bar(i, min(tps), color=color)
        ax_x.text(i, min(tps), f"{min(tps):.0f}", ha="center", va="bottom", fontsize=7)
    for ax in (ax_t, ax_x):
        ax.set_ylim(top=ax.get_ylim()[1] * 1.12)  # room for the numbers over the tallest bar
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax_t.set_ylabel("ms / token (bar: slowest run; dark: fastest; line: floor)")
    ax_x.set_ylabel("decode tokens / s (slowest run)")
    contexts = "/".join(f"{n // 1024}k" for n in sorted({r["context"] for r in rows}))
    budgets = "/".join(str(b) for b in sorted({r["budget"] for r in rows if r.get("budget") is not None}))
    ax_t.set_title(f"{env.get('gpu')} (tp > 1: orange) | torch {env['torch']} | context {contexts}, budget "
                   f"{budgets or '-'} | x = time over the rank's floor")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    plot_tp(args.json, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
