#!/usr/bin/env python3
"""timeline.py: where one forward's time goes, from bench_moe's trace.

    MOEK_TRACE_OUT=trace bench_moe --only qwen3-30b-a3b --tokens 8
        (a build with EXTRA_NVCCFLAGS=-DMOEK_TRACE: kernels/cuda/trace.cuh)
    python3 kernels/bench/timeline.py trace-qwen3-30b-a3b-8.csv ...
        (--wtiles 2 for a trace of the 144-row tile, whose item events
        are runs of two weight tiles)

Per file: when each kernel's CTAs start and end (us from the first event),
each GEMM's items (consumer 0's first stage to its last MMA: the weight
bytes of an item over that time, against one SM's share of the read
ceiling given by --read-gbs), the gaps between a CTA's items (its
epilogue, then the wait for the next item's first stage; when the producer
issued that stage's first load, and its latency), what each SM
does between GEMM 1 and GEMM 2 (its GEMM 1 CTA leaves, its GEMM 2 CTA
enters, issues its first weight load, has that stage), when each SM's
first GEMM 1 load goes out after the kernels before GEMM 1 end (and, in
parts, when its wait for them ends and when it has the tile list), the
SM time left idle after each GEMM's first CTA leaves, and the weight bytes
the consumers take in each 2 us of the last 20 us (whether DRAM idles in
the tail); with --pairs, in cluster mode, how far apart the two CTAs of
each pair run. Where both GEMMs run in one launch (moek_dep mode 3),
GEMM 2's items are reported under GEMM 1's CTAs.
"""
import argparse
import csv
import statistics
import sys
from collections import defaultdict

# kinds: kernels/cuda/trace.h (MOEK_TR_*)
ROUTE, ALIGN, GEMM, RELIST, FINAL, PERMUTE = 1, 3, 10, 30, 40, 50
ENTRY, FIRST, EXIT, ITEM, ITEM_END, EPI_END, ISSUE = 0, 1, 2, 3, 4, 5, 6
WAITED, LISTED, ITEM_END1 = 7, 8, 9
STAGE_BYTES = 128 * 64 * 2  # one weight tile's K block (MOEK_WTILE x MOEK_KTILE)


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def fmt(v):
    if not v:
        return "-"
    return "p10 %.2f p50 %.2f p90 %.2f max %.2f" % (
        pct(v, 0.1), pct(v, 0.5), pct(v, 0.9), max(v))


def span(rows, kind):
    t = [r["us"] for r in rows if r["kind"] == kind]
    return (min(t), max(t), len(t)) if t else None


def per_sm(rows, kind):
    """Each SM's earliest event of a kind, us."""
    first = {}
    for r in rows:
        if r["kind"] == kind and (r["sm"] not in first
                                  or r["us"] < first[r["sm"]]):
            first[r["sm"]] = r["us"]
    return first


def print_parts(steps):
    """Per SM, the time from one event to the next, one line a step
    (name, earlier {sm: us}, later {sm: us}); steps with no SM in both
    are left out."""
    for name, a, b in steps:
        d = [b[sm] - a[sm] for sm in a if sm in b]
        if d:
            print("            -> %-10s us %s" % (name, fmt(d)))


def pair_skew(times):
    """Cluster mode's pairs (CTAs 2c and 2c + 1 take the same items'
    token rows), from report()'s times ({CTA: (item n's first stage, last
    MMA, epilogue end), each a list in item order}): per item, how far
    apart the two CTAs' consumer 0 are at each point, and the share of
    items where the odd CTA is the later one."""
    for j, name in enumerate(("first stage", "last MMA", "epilogue end")):
        d = []
        for c, t in times.items():
            if c % 2 or c + 1 not in times:
                continue
            a, b = t[j], times[c + 1][j]
            d.extend(b[n] - a[n] for n in range(min(len(a), len(b))))
        if d:
            print("            pair skew, %-12s |odd - even| us %s; odd "
                  "later in %.0f%%" % (name, fmt([abs(v) for v in d]),
                                      100.0 * sum(v > 0 for v in d) / len(d)))


def report(path, read_gbs, sms, wtiles, pairs):
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append({k: int(v) for k, v in r.items()})
    for r in rows:
        r["us"] = r["ns"] / 1000.0
    stage = STAGE_BYTES * wtiles  # weight bytes of an item event's K block
    end = max(r["us"] for r in rows)
    print("# %s: %d events, %.2f us first to last" % (path, len(rows), end))
    for name, base in (("routing", ROUTE), ("align", ALIGN),
                       ("relist", RELIST), ("copy of x", PERMUTE),
                       ("finalize", FINAL)):
        s, e = span(rows, base), span(rows, base + 1)
        if s:
            print("%-10s CTAs %d, start %.2f-%.2f, end %s" %
                  (name, s[2], s[0], s[1],
                   "%.2f-%.2f" % (e[0], e[1]) if e else "-"))
    share = read_gbs / sms  # GB/s of one SM
    exits = {}
    spans = []  # every item: (first stage, last MMA, weight bytes)
    for g in (0, 1):
        k = GEMM + 10 * g
        ent = span(rows, k + ENTRY)
        ex = [r["us"] for r in rows if r["kind"] == k + EXIT]
        if ent:
            first = span(rows, k + FIRST)
            # cluster mode's producer (produce_mc) records no first load
            print("GEMM %d    CTAs %d, enter %.2f-%.2f, first load %s, "
                  "consumers leave %.2f-%.2f (p50 %.2f)" %
                  (g + 1, ent[2], ent[0], ent[1],
                   "%.2f" % first[0] if first else "-",
                   min(ex), max(ex), pct(ex, 0.5)))
        elif any(r["kind"] == k + ITEM for r in rows):
            # both GEMMs in one launch (moek_dep mode 3): GEMM 2's items
            # run in GEMM 1's CTAs, which record the entry and exit
            print("GEMM %d    in GEMM 1's CTAs" % (g + 1))
        else:
            continue
        # consumer 0's item events and the producer's issues, per CTA and
        # kind, in order: item n is the n-th of each kind
        per = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if (k + ITEM <= r["kind"] <= k + ISSUE or
                    r["kind"] == k + ITEM_END1):
                per[r["cta"]][r["kind"] - k].append(r)
        dur, rate, gaps, kbs, first_item = [], [], [], [], []
        epi, wait, lead, lat = [], [], [], []
        skew1, lead1, pwait, since = [], [], [], []
        times = {}  # per CTA, for pair_skew
        for cta, ev in per.items():
            it, en, ep, iss, en1 = ([r["us"] for r in sorted(ev[x],
                                                             key=lambda r: r["ns"])]
                                    for x in (ITEM, ITEM_END, EPI_END, ISSUE,
                                              ITEM_END1))
            # the producer's time from its load before to its wait for
            # each item's first stage (ns, the issue event's a) and that
            # wait (b); 0 in older traces and for stages issued before the
            # wait for the kernel before
            for r in ev[ISSUE]:
                if r["b"] > 0:
                    since.append(r["a"] / 1000.0)
                    pwait.append(r["b"] / 1000.0)
            if not ent:
                # mode 3: GEMM 2's first item records the epilogue end of
                # the CTA's last GEMM 1 item
                ep = ep[1:]
            times[cta] = (it, en, ep)
            kb = [r["b"] for r in sorted(ev[ITEM], key=lambda r: r["ns"])]
            if it:
                first_item.append(it[0])
            for n in range(min(len(it), len(en))):
                spans.append((it[n], en[n], kb[n] * stage))
                d = en[n] - it[n]
                dur.append(d)
                kbs.append(kb[n])
                if d > 0:
                    rate.append(kb[n] * stage / d / 1e3)
            # the gap before item n in parts: consumer 0's epilogue of item
            # n - 1, then its wait for item n's first stage; that stage's
            # first load, issued by the producer before (+) or after (-)
            # item n - 1's last MMA, and its latency (issue to consumer 0
            # having the stage)
            for n in range(1, len(it)):
                if n - 1 < len(en):
                    gaps.append(it[n] - en[n - 1])
                if n - 1 < len(en) and n - 1 < len(ep):
                    epi.append(ep[n - 1] - en[n - 1])
                    wait.append(it[n] - ep[n - 1])
                if n < len(iss) and n - 1 < len(en):
                    lead.append(en[n - 1] - iss[n])
                    lat.append(it[n] - iss[n])
                # consumer 1 (traces that have it): its last MMA against
                # consumer 0's, and the next load against the later one
                if n < len(iss) and n - 1 < min(len(en), len(en1)):
                    lead1.append(max(en[n - 1], en1[n - 1]) - iss[n])
            for n in range(min(len(en), len(en1))):
                skew1.append(en1[n] - en[n])
        print("          items %d, K blocks %s" % (len(dur), fmt(kbs)))
        print("          item us %s" % fmt(dur))
        print("          item GB/s %s (one SM's share of %.0f: %.1f)" %
              (fmt(rate), read_gbs, share))
        print("          first item at %s" % fmt(first_item))
        print("          between items us %s" % fmt(gaps))
        if epi or lead:
            print("            epilogue us %s" % fmt(epi))
            print("            then waits us %s" % fmt(wait))
            print("            next item's first load issued us before the "
                  "last MMA %s" % fmt(lead))
            print("            its latency us %s" % fmt(lat))
        if skew1:
            print("            consumer 1's last MMA after consumer 0's us "
                  "%s" % fmt(skew1))
            print("            next item's first load before the later "
                  "consumer's last MMA us %s" % fmt(lead1))
        if pwait:
            print("            the producer's wait for that stage us %s" %
                  fmt(pwait))
            print("            from the producer's load before to that "
                  "wait us %s" % fmt(since))
        if pairs:
            pair_skew(times)
        if not ex:
            continue
        idle = sum(max(ex) - t for t in ex)
        print("          after the first consumer leaves: %.2f us, %.1f "
              "SM-us idle (%.2f us of the whole card)" %
              (max(ex) - min(ex), idle, idle / sms))
        exits[g] = {r["sm"]: r["us"] for r in rows if r["kind"] == k + EXIT}
    its = [r for r in rows if r["kind"] in (GEMM + ITEM, GEMM + 10 + ITEM)]
    ends = [r["us"] for r in rows
            if r["kind"] in (GEMM + ITEM_END, GEMM + 10 + ITEM_END)]
    if its and ends:
        t0, t1 = min(r["us"] for r in its), max(ends)
        gb = sum(r["b"] for r in its) * stage / 1e9
        print("weights   %.1f MB from the first item's first stage (%.2f) to "
              "the last MMA (%.2f): %.0f GB/s" %
              (gb * 1e3, t0, t1, gb / ((t1 - t0) * 1e-6)))
        # the last 20 us: each item's bytes spread evenly over its time,
        # summed over CTAs in 2 us bins (does DRAM idle in the tail?);
        # items much longer than a bin (mixtral T=512's GEMM 2) smear it
        bins = [0.0] * 10
        for s0, s1, b in spans:
            for i in range(10):
                lo, hi = t1 - 20 + 2 * i, t1 - 18 + 2 * i
                ov = min(hi, s1) - max(lo, s0)
                if ov > 0 and s1 > s0:
                    bins[i] += b * ov / (s1 - s0)
        print("tail      weight GB/s in 2 us bins up to the last MMA: %s" %
              " ".join("%.0f" % (v / 2e3) for v in bins))
    if 0 in exits and 1 in exits:
        k = GEMM + 10
        g2_first = per_sm(rows, k + ITEM)
        hand = [g2_first[sm] - t for sm, t in exits[0].items()
                if sm in g2_first]
        print("handoff   GEMM 1 consumer leaves -> GEMM 2's first item on "
              "that SM, us %s" % fmt(hand))
        # the same in parts, per SM: GEMM 2's CTA enters, its producer
        # issues its first weight load, consumer 0 has that stage
        ent2, load2 = per_sm(rows, k + ENTRY), per_sm(rows, k + FIRST)
        print_parts((("CTA enters", exits[0], ent2),
                     ("first load", ent2, load2),
                     ("first item", load2, g2_first)))
    # GEMM 1's first load on each SM after the last kernel before it ends
    before = [r["us"] for r in rows if r["kind"] in (ROUTE + 1, ALIGN + 1,
                                                    RELIST + 1, PERMUTE + 1)]
    load1 = per_sm(rows, GEMM + FIRST)
    if before and load1:
        t0 = max(before)
        print("start     GEMM 1's first load after routing ends (%.2f), us "
              "%s" % (t0, fmt([t - t0 for t in load1.values()])))
        # in parts, per SM: past its wait for the kernel before, has the
        # tile list, issues its first weight load
        waited, listed = per_sm(rows, GEMM + WAITED), per_sm(rows, GEMM + LISTED)
        print_parts((("wait ends", dict.fromkeys(load1, t0), waited),
                     ("has list", waited, listed),
                     ("first load", listed, load1)))
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--read-gbs", type=float, default=4515.0)
    ap.add_argument("--sms", type=int, default=132)
    # The 144-row tile's CTAs take two weight tiles an item event (a run
    # of two items: moek_wtiles), so each K block brings twice the bytes.
    ap.add_argument("--wtiles", type=int, default=1,
                    help="weight tiles an item event stands for (2 for "
                         "the 144-row tile)")
    ap.add_argument("--pairs", action="store_true",
                    help="cluster mode: the skew between the CTAs of "
                         "each pair")
    a = ap.parse_args()
    for p in a.csv:
        report(p, a.read_gbs, a.sms, a.wtiles, a.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
