#!/bin/sh
# tests/fuzz/run.sh: run each libFuzzer target in $BUILD/fuzz for
# $FUZZ_SECONDS seconds from its seed corpus (tests/fuzz/corpus/<target>) and
# its crash regressions (tests/fuzz/regress/<target>), and print one line per
# target that tests/run.sh counts:
#
#   PASS fuzz_request: 123456 executions, coverage 2345 edges (6789 features), corpus 321, 30 s
#   FAIL fuzz_request (crash; input saved as build/fuzz/crash-request-...)
#
# New corpus entries go to a temporary directory, or with FUZZ_KEEP=1 (make
# fuzz) to $BUILD/fuzz/corpus-<target>, which later runs start from. A crash
# leaves its input in $BUILD/fuzz/; once fixed, it belongs in
# tests/fuzz/regress/<target>/, where every make test replays it.
set -u
BUILD=${BUILD:-build}
S=${FUZZ_SECONDS:-30}
out=$BUILD/fuzz
mkdir -p "$out"
status=0
for t in request safetensors config; do
    bin=$out/fuzz_$t
    if [ ! -x "$bin" ]; then
        echo "SKIP fuzz_$t (not built: clang not found; 'make deps' installs clang and libclang-rt-14-dev)"
        continue
    fi
    if [ "${FUZZ_KEEP:-0}" = 1 ]; then
        corpus=$out/corpus-$t
        mkdir -p "$corpus"
    else
        corpus=$(mktemp -d)
    fi
    dirs="$corpus tests/fuzz/corpus/$t"
    [ -d "tests/fuzz/regress/$t" ] && dirs="$dirs tests/fuzz/regress/$t"
    log=$out/fuzz_$t.log
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$bin" -max_total_time="$S" -timeout=25 -rss_limit_mb=2048 -max_len=8192 \
        -print_final_stats=1 -artifact_prefix="$out/crash-$t-" $dirs >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    [ "${FUZZ_KEEP:-0}" = 1 ] || rm -rf "$corpus"
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
    cov=$(echo "$last" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
    ft=$(echo "$last" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')
    corp=$(echo "$last" | sed -n 's/.* corp: \([0-9]*\).*/\1/p')
    if [ "$rc" -eq 0 ]; then
        echo "PASS fuzz_$t: ${execs:-?} executions, coverage ${cov:-?} edges (${ft:-?} features), corpus ${corp:-?}, $secs s"
    else
        tail -n 40 "$log"
        crash=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        # What failed, in a few lines that the stack trace above cannot push
        # out of a log's tail: the target's own check (FUZZ_CHECK prints
        # file:line: condition: message), a sanitizer's report, or
        # libFuzzer's verdict (timeout, out of memory, deadly signal).
        echo "-- fuzz_$t failed on:"
        grep -E '^tests/fuzz/[a-z_]+\.c:[0-9]+: |runtime error|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|^SUMMARY: ' \
            "$log" | head -n 6
        if [ -n "$crash" ] && [ -f "$crash" ]; then
            # Run the saved input again, alone, from a fresh process: a
            # failure that does not come back depends on timing (or on the
            # inputs before it), which is worth knowing before reading code.
            again=0
            for _ in 1 2 3; do
                "$bin" -timeout=25 -rss_limit_mb=2048 "$crash" >"$log.replay" 2>&1 || again=$((again + 1))
            done
            echo "-- the saved input, run again alone: failed $again of 3 times"
            [ "$again" -gt 0 ] && grep -E '^tests/fuzz/[a-z_]+\.c:[0-9]+: |runtime error|^SUMMARY: ' \
                "$log.replay" | head -n 4
            rm -f "$log.replay"
        fi
        echo "FAIL fuzz_$t (exit status $rc; input saved as ${crash:-?}; log $log;" \
             "reproduce with $bin ${crash:-FILE}, then add it to tests/fuzz/regress/$t/)"
        status=1
    fi
done
exit $status
