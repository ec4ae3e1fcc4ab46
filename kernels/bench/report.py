#!/usr/bin/env python3
"""report.py: the benchmark report table (markdown) from bench_moe --csv
output and peers.py's file; no GPU needed. The cuBLAS bmm column (peers.py:
the per-expert loop's work as two strided-batched calls, balanced rows, no
routing) is a reference for the GEMMs' shapes, not one of BENCH.md's peers:
it is left out of "best peer / ours" and has its own ratio.

  python3 kernels/bench/report.py OURS.csv PEERS.txt
"""
import sys


def merge(ours_path, peers_path):
    """The report table: our rows (bench_moe --csv) next to the peers."""
    peers = {}
    try:
        for line in open(peers_path):
            if line.startswith("#") or not line.strip():
                continue
            f = line.split()
            loop = float(f[4]) if len(f) > 4 else -1.0
            bmm = float(f[5]) if len(f) > 5 else -1.0
            peers[(f[0], int(f[1]))] = (float(f[2]), float(f[3]), loop, bmm)
    except OSError as e:
        print(f"# no peer figures: {e}")
    head = ""
    rows = []
    for line in open(ours_path):
        if line.startswith("# read_gbs"):
            head = line[2:].strip()
        if line.startswith("#") or not line.strip():
            continue
        m, t, tile, us, floor_us, hit, err = line.split()[:7]
        rows.append((m, int(t), tile, float(us), float(floor_us),
                     float(hit), float(err)))
    print(f"# {head}")
    print("| case | T | tile | us | floor us | % of floor | Triton us "
          "| grouped_mm us | cuBLAS loop us | best peer / ours | rel err "
          "| cuBLAS bmm us | bmm / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    def fmt(v):  # a peer's us, or - where it did not run
        return f"{v:.1f}" if v > 0 else "-"

    for m, t, tile, us, fl, hit, err in rows:
        tri, gro, loop, bmm = peers.get((m, t), (-1.0, -1.0, -1.0, -1.0))
        best = min([p for p in (tri, gro, loop) if p > 0], default=-1.0)

        def ratio(v):  # a peer's us over ours
            return f"{v / us:.2f}" if v > 0 else "-"

        print(f"| {m} | {t} | {tile} | {us:.1f} | {fl:.1f} | "
              f"{100 * fl / us:.1f} | {fmt(tri)} | {fmt(gro)} | {fmt(loop)} "
              f"| {ratio(best)} | {err:.1e} | {fmt(bmm)} | {ratio(bmm)} |")



if __name__ == "__main__":
    merge(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "peers.txt")
