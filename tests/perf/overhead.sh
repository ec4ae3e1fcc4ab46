#!/bin/sh
# tests/perf/overhead.sh: the daemon's own cost per request. Starts moed on
# the CPU backend with one compute thread and a tiny MoE layer (8 experts,
# top-2, hidden and intermediate 64), so compute is negligible and what is
# left is the service: ZeroMQ, decoding, validation, batching, replies. For
# each client count it runs `moectl bench` with single-token requests and
# reads, from /proc, the CPU time (schedstat, in ns) and the voluntary
# context switches (sleeps, hence wake-ups) of each of the daemon's threads
# before and after; it divides them by the requests the daemon served
# (its stats counter, so the bench's own setup is counted in the cost but
# not in the requests).
#
#   tests/perf/overhead.sh [CLIENTS...]        (default: 1 8 32)
#   SECONDS_PER_RUN=3 BUILD=build MOED_ARGS="--no-batch" tests/perf/overhead.sh 32
#   MOED_NICE=-10 tests/perf/overhead.sh 32    (the unit's priority; root)
#
# Output per client count: the bench's line, then per thread
# "us/req" (CPU) and "wake/req" (voluntary switches), and the totals.
# Not run by `make test`: the numbers depend on the machine and its load.
set -eu
BUILD=${BUILD:-build}
SECS=${SECONDS_PER_RUN:-3}
CLIENTS=${*:-1 8 32}
dir=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
# shellcheck disable=SC2086
nice -n "${MOED_NICE:-0}" "$BUILD/moed" --backend cpu -t 1 -r "$dir/rt" -l warning ${MOED_ARGS:-} 2>"$dir/log" &
pid=$!
i=0
until [ -S "$dir/rt/moed.sock" ]; do
    i=$((i + 1))
    [ $i -lt 100 ] || { cat "$dir/log"; echo "moed did not start" >&2; exit 1; }
    sleep 0.05
done
"$BUILD/moectl" -r "$dir/rt" load tiny --random --experts 8 --topk 2 --hidden 64 \
    --intermediate 64 >/dev/null

# "name cpu_ns voluntary_switches" for each thread of the daemon.
threads() {
    for t in /proc/"$pid"/task/*; do
        printf '%s %s %s\n' "$(tr ' ' _ <"$t/comm")" "$(cut -d' ' -f1 "$t/schedstat")" \
            "$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")"
    done
}
served() {
    "$BUILD/moectl" -r "$dir/rt" stats --json | awk -F'[:,]' '/"requests"/ {gsub(/[ \t]/, "", $2); print $2; exit}'
}

for n in $CLIENTS; do
    r0=$(served)
    threads >"$dir/before"
    "$BUILD/moectl" -r "$dir/rt" bench --clients "$n" --tokens 1 --seconds "$SECS" --layer tiny
    threads >"$dir/after"
    r1=$(served)
    awk -v req=$((r1 - r0)) '
        NR == FNR { cpu[$1] += $2; vol[$1] += $3; next }
        { c = $2 - cpu[$1]; v = $3 - vol[$1]; tc += c; tv += v
          printf "  %-14s %7.2f us/req %6.3f wake/req\n", $1, c / 1000 / req, v / req }
        END { printf "  %-14s %7.2f us/req %6.3f wake/req  (%d requests)\n", "daemon", tc / 1000 / req, tv / req, req }
    ' "$dir/before" "$dir/after"
done
