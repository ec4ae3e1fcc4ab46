#!/usr/bin/env python3
"""stalls.py: the instructions where a kernel's warps stall most, from ncu's
source page as CSV (device.sh's stalls step):

  ncu --section WarpStateStats --section SourceCounters -o REP ...
  ncu -i REP.ncu-rep --page source --csv --print-source sass > src.csv
  python3 kernels/bench/stalls.py src.csv [--top 40]

Prints each of the top instructions' share of all warp stall samples, its
address and its SASS text, then the shares by opcode of 0.2% and more
(the SASS text's first word after any predicate, modifiers dropped:
HGMMA, BRA, BAR, ...), which sum an epilogue's many small instructions.
No GPU needed.
"""
import argparse
import csv


def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.csv, errors="replace") as f:
        rows = list(csv.reader(f))
    head, ci = next(((i, j) for i, r in enumerate(rows)
                     for j, c in enumerate(r)
                     if "Warp Stall Sampling (All" in c), (None, None))
    if head is None:
        print("stalls.py: no 'Warp Stall Sampling (All Samples)' column; "
              "the file begins:")
        for r in rows[:8]:
            print("  " + ",".join(r)[:200])
        return 1
    si = next((j for j, c in enumerate(rows[head])
               if c.strip() in ("Source", "SASS")), 1)
    # (samples, address, SASS) per instruction, most samples first
    body = sorted(((num(r[ci]), r[0], r[si]) for r in rows[head + 1:]
                   if len(r) > max(ci, si)), reverse=True)
    total = sum(b[0] for b in body)
    if total <= 0:
        print("stalls.py: no samples")
        return 1
    print(f"# {total:.0f} warp stall samples; top {args.top} instructions")
    for n, addr, sass in body[:args.top]:
        print(f"{100 * n / total:5.1f}% {addr} {sass[:90]}")
    ops = {}
    for n, _, sass in body:
        words = [w for w in sass.split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        ops[op] = ops.get(op, 0.0) + n
    print("# by opcode: " + ", ".join(
        f"{op} {100 * v / total:.1f}%"
        for op, v in sorted(ops.items(), key=lambda kv: -kv[1])
        if v / total >= 0.002))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
