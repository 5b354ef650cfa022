"""Where a kernel's warps spend their time, read off Nsight Compute's source page (SASS) as text.

    ncu --clock-control none -k regex:NAME --launch-skip 1 --launch-count 1 --section SourceCounters \
        --page source --print-source sass --csv python SCRIPT.py > k.csv      # on the GPU machine (HOPPER.md)
    python -m kvrewrite.bench.ncu_source k.csv [--top 25]

Prints the stall reasons' shares of the warp samples, the opcodes' shares of the executed instructions and of the
samples, the hot path (the instructions executed as often as the most executed one: a loop body's branch taken
most, per warp) with its opcode mix, and the instructions holding the most samples. Why: stop 56 found the EMS
fold's per-block mask decision and the redundancy's per-column loads this way (docs/bench.md "Stop 56 runs"); the
counts to compare with an offline compile's loops (occupancy.sass_loops).
"""
import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> list:
    """The source page's rows (dicts by column name) of an `ncu --page source --csv` export; ncu's own lines before
    the table (its log, the kernel's name) are skipped."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith('"Address"'):
            return list(csv.DictReader(lines[i:]))
    raise ValueError(f"ncu_source: no source table in {path} (a header row starting with \"Address\"): export it with "
                     "--page source --print-source sass --csv")


def _int(row: dict, key: str) -> int:
    return int(row.get(key) or 0)


def _opcode(row: dict) -> str:
    words = row["Source"].split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0] if words else "?"


def _shares(counter: Counter, total: int, top: int) -> list:
    return [(k, round(100.0 * v / total, 1)) for k, v in counter.most_common(top)] if total else []


def summary(rows: list, top: int = 25) -> dict:
    """samples, stalls / executed / sampled [(name, % of the total)], hot_count (executions of the most executed
    instruction: a warp's passes through its loop), hot_path (instructions at that count), hot_mix (their opcodes),
    hottest [(samples, executions, text)]."""
    samples = sum(_int(r, SAMPLES) for r in rows)
    stall_cols = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    stalls = Counter({k[len("stall_"):]: sum(_int(r, k) for r in rows) for k in stall_cols})
    executed, sampled = Counter(), Counter()
    for r in rows:
        executed[_opcode(r)] += _int(r, EXECUTED)
        sampled[_opcode(r)] += _int(r, SAMPLES)
    hot_count = max((_int(r, EXECUTED) for r in rows), default=0)
    hot = [r for r in rows if hot_count and _int(r, EXECUTED) == hot_count]
    hottest = sorted(rows, key=lambda r: -_int(r, SAMPLES))[:top]
    return dict(samples=samples, stalls=_shares(stalls, samples, 10),
                executed=_shares(executed, sum(executed.values()), top), sampled=_shares(sampled, samples, top),
                hot_count=hot_count, hot_path=len(hot), hot_mix=Counter(_opcode(r) for r in hot).most_common(top),
                hottest=[(_int(r, SAMPLES), _int(r, EXECUTED), r["Source"].strip()) for r in hottest])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="an `ncu --page source --print-source sass --csv` export")
    parser.add_argument("--top", type=int, default=25, help="rows of each list (default 25)")
    args = parser.parse_args(argv)
    s = summary(read(args.csv), args.top)
    print(f"{s['samples']} warp samples; stall reasons (% of them): {s['stalls']}")
    print(f"opcodes, % of the executed instructions: {s['executed']}")
    print(f"opcodes, % of the samples: {s['sampled']}")
    print(f"hot path: {s['hot_path']} instructions executed {s['hot_count']} times each; mix: {s['hot_mix']}")
    print("the instructions with the most samples (samples, executions, instruction):")
    for n, e, text in s["hottest"]:
        print(f"  {n:8d} {e:10d}  {text}")


if __name__ == "__main__":
    main()
