#!/bin/sh
# tests/run.sh: run every test binary under $BUILD/tests (unit tests first,
# then integration tests, then the fuzz targets for FUZZ_SECONDS each), count
# the PASS / FAIL / SKIP lines they print, and end with the summary line
# "N passed, M failed". A binary that dies without
# reporting its cases counts as one failure. Exit status 1 if anything failed.
set -u
BUILD=${BUILD:-build}
passed=0 failed=0 skipped=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

for t in "$BUILD"/tests/test_* "$BUILD"/tests/itest_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    echo "== $name"
    start=$(date +%s)
    "$t" >"$log" 2>&1
    rc=$?
    cat "$log"
    p=$(grep -c '^PASS ' "$log")
    f=$(grep -c '^FAIL ' "$log")
    s=$(grep -c '^SKIP ' "$log")
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name (exit status $rc without a failed case)"
        f=1
    fi
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    echo "   $name: $p passed, $f failed, $s skipped in $(( $(date +%s) - start )) s"
done

# Fuzzing for a bounded time (FUZZ_SECONDS per target, 0: not at all).
if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then
    echo "== fuzz (${FUZZ_SECONDS} s per target)"
    start=$(date +%s)
    BUILD=$BUILD FUZZ_SECONDS=$FUZZ_SECONDS tests/fuzz/run.sh >"$log" 2>&1
    cat "$log"
    p=$(grep -c '^PASS ' "$log")
    f=$(grep -c '^FAIL ' "$log")
    s=$(grep -c '^SKIP ' "$log")
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    echo "   fuzz: $p passed, $f failed, $s skipped in $(( $(date +%s) - start )) s"
fi

echo "skipped: $skipped"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
