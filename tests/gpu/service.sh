#!/bin/sh
# tests/gpu/service.sh: moed as a service on a GPU machine, with the
# binaries that tests/gpu/carry.sh gathered. Checks the daemon's CUDA path
# against the reference (demo layers, --check), runs the integration tests
# against the CUDA backend, then measures on a mixtral-8x7b-shaped layer
# with random weights:
#   - the bare ZeroMQ round trip (moectl zmq-rtt), the daemon's ping, and a
#     T=1 FusedMoe round trip through the daemon (p50/p99);
#   - moectl bench with 1, 4, 16 and 32 clients, batching on and off.
# STEPS=tune: moed --tune on the demo layer's and the three BENCH.md shapes
# (the time it takes, the table it writes), then a daemon that serves the
# demo layer with that table, checked against the reference.
# Logs and JSON go to $OUT (or /tmp/moed-gpu-out).
set -u
OUT=${OUT:-/tmp/moed-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.carry/bin
SECONDS_PER=${SECONDS_PER:-4}
STEPS=${STEPS:-"check itest service"}  # also: tune shapes compare shard variants spin
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$B/moed --version || { echo "moed does not run here"; ldd $B/moed; exit 1; }

# moed at the unit's priority (packaging/moed.service.in: Nice=-10);
# MOED_NICE=0 for the former runs' setting.
start_daemon() { # runtime dir, extra args
    rt=$1; shift
    rm -rf "$rt"
    nice -n "${MOED_NICE:--10}" $B/moed --runtime-dir "$rt" --backend cuda "$@" \
        >"$OUT/moed-$(basename "$rt").log" 2>&1 &
    for _ in $(seq 300); do
        $B/moectl -r "$rt" info >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "moed did not start"; cat "$OUT/moed-$(basename "$rt").log"; return 1
}

if has check; then
echo "### correctness through the daemon (demo layers, CUDA backend)"
start_daemon /tmp/moed-demo --demo || exit 1
M="$B/moectl -r /tmp/moed-demo"
$M info
# Each routing path of the demo layer (k = 2): T k <= 32 one warp (1, 3,
# 16), T <= 32 one block (20), T <= 64 two CTAs (48), more: several (100,
# 700).
# The checks' lines also go to $OUT/check.log, where a long run's output
# cannot push them out of sight.
for t in 1 3 16 20 48 100 700; do $M forward --layer demo --tokens $t --check; done 2>&1 |
    tee "$OUT/check.log"
for m in 1 50 333; do $M gemm --layer demo-gemm --rows $m --check; done 2>&1 |
    tee -a "$OUT/check.log"
kill $!; wait
fi

if has itest; then
echo "### integration tests against the CUDA backend (each case bounded)"
for t in ${ITESTS:-itest_service itest_batch itest_badinput}; do
    for c in ${ITEST_CASES:-$(.carry/tests/$t --list 2>/dev/null)}; do
        MOE_TEST_BACKEND=cuda BUILD=.carry/bin timeout ${ITEST_TIMEOUT:-60} .carry/tests/$t $c \
            >"$OUT/itest.log" 2>&1
        echo "$t $c: exit $?; $(grep -E '^(PASS|FAIL|SKIP)|check failed|:[0-9]+: ' "$OUT/itest.log" | head -3 | tr '\n' ' ')"
    done
done
tail -n 30 "$(ls -td /tmp/moed-itest.* 2>/dev/null | head -1)/moed.log" 2>/dev/null
fi

if has shapes; then
echo "### small shapes of the integration tests, one daemon each (a hang shows as a timeout)"
for sh in "8 2 64 96 bf16 softmax" "8 3 32 48 fp16 softmax" "16 4 48 64 fp16 sigmoid" \
          "16 2 32 32 bf16 sigmoid" "8 2 40 56 fp16 given" "4 1 64 64 bf16 given" \
          "8 2 64 128 bf16 softmax" "16 4 128 192 bf16 softmax" "8 2 256 512 bf16 softmax" \
          "8 2 512 1024 bf16 softmax" "4 2 32 48 bf16 softmax"; do
    set -- $sh
    start_daemon /tmp/moed-shape >/dev/null || { echo "$sh: no daemon"; continue; }
    pid=$!
    M="$B/moectl -r /tmp/moed-shape"
    $M load s --random --experts $1 --topk $2 --hidden $3 --intermediate $4 --dtype $5 --routing $6 >/dev/null
    for t in 1 5 33; do
        r=$(timeout 8 $M forward --layer s --tokens $t 2>&1); rc=$?
        echo "E=$1 k=$2 H=$3 I=$4 $5 $6 T=$t: exit $rc $(echo "$r" | tail -n 1)"
    done
    kill -9 $pid; wait $pid 2>/dev/null
done
fi

if has service; then
echo "### service latency and batching, mixtral-8x7b shape, random bf16 weights"
start_daemon /tmp/moed-svc || exit 1
M="$B/moectl -r /tmp/moed-svc"
$M load mixtral --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 || exit 1
$M zmq-rtt --count 20000 | tee "$OUT/zmq-rtt.txt"
$M ping --count 20000 | tee "$OUT/ping.txt"
$M forward --layer mixtral --tokens 1 --repeat 3000 | tee "$OUT/forward-t1.txt"
for c in 1 4 16 32; do
    for mode in "" "--no-batch"; do
        $M bench --layer mixtral --clients $c --tokens 1 --seconds "$SECONDS_PER" $mode --json \
            | tee -a "$OUT/bench.jsonl"
    done
done
$M stats | tee "$OUT/stats.txt"
kill $!; wait
fi

if has shard; then
echo "### a layer spread over every GPU of the machine (2 or more)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# libnccl.so.2: the toolkit's, else the one PyTorch ships.
for d in /usr/local/cuda/lib /usr/local/cuda/lib64 \
         "$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null)"; do
    if [ -n "$d" ] && [ -e "$d/libnccl.so.2" ]; then
        export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"; echo "NCCL from $d"; break
    fi
done
nvidia-smi topo -m 2>&1 | head -n 8
timeout 120 .carry/tests/test_cuda_kernels moe_shards 2>&1 | tail -n 8
MOE_TEST_BACKEND=cuda BUILD=.carry/bin timeout 300 .carry/tests/itest_shard 2>&1 \
    | grep -E '^(PASS|FAIL|SKIP)|check failed|:[0-9]+: '
timeout 400 .carry/bin/bench_ep ${EP_ARGS:-} 2>&1 | tee "$OUT/bench_ep.txt"
for tr in nccl peer; do
    start_daemon /tmp/moed-ep --gpus all --transport $tr || exit 1
    M="$B/moectl -r /tmp/moed-ep"
    $M info | grep -i -E "device|gpu" | head -n 4
    $M load one --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 >/dev/null || exit 1
    $M load two --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 --devices 0,1 \
        >/dev/null || exit 1
    $M layers
    for t in 1 64 512 4096; do
        n=$(( t >= 512 ? 200 : 1000 ))
        for l in one two; do
            echo "daemon $tr layer=$l T=$t: $($M forward --layer $l --tokens $t --repeat $n | tail -n 1)"
        done
    done
    kill $!; wait
done
fi

if has variants; then
echo "### 32 clients under daemon settings (VARIANTS, ';'-separated argument lists)"
echo "${VARIANTS:---io-threads 1;--io-threads 4;--return-wait-us 150;--return-wait-us 600}" | tr ';' '\n' |
while read -r args; do
    start_daemon /tmp/moed-var $args </dev/null || exit 1
    M="$B/moectl -r /tmp/moed-var"
    $M load mixtral --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 >/dev/null </dev/null || exit 1
    for c in ${VARIANT_CLIENTS:-32}; do
        echo "[$args] clients $c: $($M bench --layer mixtral --clients $c --tokens 1 --seconds "$SECONDS_PER" --json </dev/null)"
        $M stats </dev/null | grep -E "^(queue|between)" | sed "s/^/[$args] /"
    done
    kill $!; wait
done
fi

if has spin; then
echo "### idle clients: ping after an idle gap; clients that busy-poll for replies (all along, or around the time they come)"
start_daemon /tmp/moed-spin || exit 1
M="$B/moectl -r /tmp/moed-spin"
for iv in 0 200 1000; do echo "gap $iv us: $($M ping --count 3000 --interval-us $iv)"; done
kill $!; wait
# SPIN_US entries: U (--client-spin-us U) or aA (--client-spin-ahead-us A).
for c in ${SPIN_CLIENTS:-16 32}; do
    for sp in ${SPIN_US:-0 1500 a150}; do
        case $sp in
        a*) opt="--client-spin-ahead-us ${sp#a}" ;;
        *) opt="--client-spin-us $sp" ;;
        esac
        start_daemon /tmp/moed-spin </dev/null || exit 1
        $M load mixtral --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 >/dev/null </dev/null || exit 1
        echo "clients $c $opt: $($M bench --layer mixtral --clients $c --tokens 1 --seconds "$SECONDS_PER" $opt --json </dev/null)"
        $M stats </dev/null | grep -E "^(queue|between)" | sed "s/^/    /"
        kill $!; wait
    done
done
fi

if has tune; then
echo "### moed --tune: the demo shape and the BENCH.md shapes, then the demo layer served with the table"
rm -f "$OUT/tiles.tsv"
t0=$(date +%s)
$B/moed --tune --backend cuda --demo --tile-table "$OUT/tiles.tsv" --tune-shape 8,2,4096,14336 \
    --tune-shape 128,8,2048,768 --tune-shape 256,8,7168,2048 >"$OUT/tune.txt"
echo "moed --tune: exit $?, $(( $(date +%s) - t0 )) s"
cat "$OUT/tune.txt" "$OUT/tiles.tsv"
start_daemon /tmp/moed-tune --demo --tile-table "$OUT/tiles.tsv" || exit 1
M="$B/moectl -r /tmp/moed-tune"
for t in 1 3 16 100 700 4096; do $M forward --layer demo --tokens $t --check; done
grep -E "tile table|token tiles" "$OUT/moed-moed-tune.log"
kill $!; wait
fi

if has compare; then
echo "### the same daemon without spinning, and without waiting for returning clients"
start_daemon /tmp/moed-cmp --spin-us 0 --return-wait-us 0 || exit 1
M="$B/moectl -r /tmp/moed-cmp"
$M load mixtral --random --experts 8 --topk 2 --hidden 4096 --intermediate 14336 >/dev/null || exit 1
$M forward --layer mixtral --tokens 1 --repeat 3000 | sed 's/^/spin 0: /'
$M bench --layer mixtral --clients 32 --tokens 1 --seconds "$SECONDS_PER" --json | sed 's/^/no return wait: /'
kill $!; wait
fi
echo "### done"
