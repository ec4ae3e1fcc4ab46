#!/bin/sh
# tests/demo.sh: what `make run` shows. Starts moed on its built-in demo
# layers in a temporary runtime directory, runs a checked forward pass, a
# checked grouped GEMM and a short bench against it, prints the daemon's
# stats, then stops the daemon (SIGTERM: it drains and exits 0).
set -eu
BUILD=${BUILD:-build}
rt=$(mktemp -d /tmp/moed-demo.XXXXXX)
log="$rt/moed.log"
"$BUILD/moed" --demo --runtime-dir "$rt" >"$log" 2>&1 &
pid=$!
cleanup() {
    kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$rt"
}
trap cleanup EXIT
for _ in $(seq 100); do
    [ -S "$rt/moed.zmq" ] && "$BUILD/moectl" -r "$rt" info >/dev/null 2>&1 && break
    sleep 0.1
done
M="$BUILD/moectl -r $rt"
echo "### moectl info";                       $M info
echo "### moectl layers";                     $M layers
echo "### moectl forward --layer demo --tokens 16 --check"
$M forward --layer demo --tokens 16 --check
echo "### moectl gemm --layer demo-gemm --rows 64 --check"
$M gemm --layer demo-gemm --rows 64 --check
echo "### moectl ping --count 500";           $M ping --count 500
echo "### moectl bench --clients 4 --tokens 1 --seconds 2"
$M bench --clients 4 --tokens 1 --seconds 2
echo "### moectl stats";                      $M stats
kill -TERM "$pid"
wait "$pid"
echo "### moed log"
cat "$log"
trap 'rm -rf "$rt"' EXIT
