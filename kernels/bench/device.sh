#!/usr/bin/env bash
# device.sh: build, check and benchmark the CUDA kernels in one call on the
# GPU machine (any machine with nvcc and an sm_90 card).
#
#   bash kernels/bench/device.sh                 everything
#   STEPS="build quick bench" bash kernels/bench/device.sh
#
# Steps: build (nvcc here, the bench Makefile: no daemon libraries needed),
# quick (the test cases that exercise every kernel variant, short timeout:
# a hang ends the run early), bench (bench_moe --sweep --csv), variants (the
# T=1 cases again without early weight loads, and without PDL), ab (builds
# or switches against each other, interleaved: AB_RUNS over AB_CASES), ncu
# (per-kernel times of one forward at NCU_TOKENS), bound (what binds each
# GEMM of BOUND_CASES: ncu's throughputs, DRAM and L2 bytes, memory
# tables and warp states), stalls (where one GEMM's warps stall, by
# instruction: STALL_CASE, STALL_SKIP), cublas (the kernels cuBLAS runs at
# the T=4096 shapes, by ncu), peers (peers.py), test
# (the whole CUDA unit test), sanitize (compute-sanitizer over the unit
# test's small cases), report (report.py). Logs and the tables go to $OUT
# (8 files at most, or /tmp/moek-out); the report table prints last.
#
#   OUT=$OUT/ab STEPS=ab AB_RUNS="main=DIR1/bench_moe new=DIR2/bench_moe
#     off=DIR2/bench_moe,MOEK_CUDA_NO_BOTH=1" AB_CASES="qwen3-30b-a3b:8
#     deepseek-v3:4096:--tile,144" AB_ROUNDS=2 bash kernels/bench/device.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moek-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"build quick bench variants peers test report"}
B=$PWD/build-dev
# ncu, for the ncu, bound, stalls and cublas steps
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# The tests run a debug build whose pipeline waits trap after 4 s instead of
# hanging (MOEK_WATCHDOG); the benchmark runs the daemon's exact code.
T=$B-dbg/bench/test_cuda_kernels
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
echo "# $(git rev-parse --short HEAD 2>/dev/null || echo 'uncommitted') $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1

if has build; then
  t0=$(date +%s)
  make -C kernels/bench BUILD="$B" -j8 all >"$OUT/build.log" 2>&1 &
  make -C kernels/bench BUILD="$B-dbg" -j8 test EXTRA_NVCCFLAGS=-DMOEK_WATCHDOG \
    >"$OUT/build-dbg.log" 2>&1 || { tail -n 40 "$OUT/build-dbg.log"; echo "BUILD FAILED"; exit 1; }
  wait $! || { tail -n 40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  cat "$OUT/build-dbg.log" >>"$OUT/build.log"; rm -f "$OUT/build-dbg.log"
  echo "# build: $(( $(date +%s) - t0 )) s"
fi
if has quick; then
  for c in cuda_device refuses_unsupported moe_every_tile grouped_gemm; do
    timeout 60 "$T" "$c" >>"$OUT/test-quick.log" 2>&1
    rc=$?
    grep -E "^(PASS|FAIL|SKIP)" "$OUT/test-quick.log" | tail -n 1
    if [ $rc -eq 124 ]; then echo "QUICK TEST $c TIMED OUT"; tail -n 30 "$OUT/test-quick.log"; exit 1; fi
  done
  grep -E "FAIL|failed|rel err|error" "$OUT/test-quick.log" | head -n 60
fi
if has bench; then
  timeout 200 "$B/bench/bench_moe" --csv "$OUT/ours.csv" ${SWEEP---sweep} >"$OUT/bench.log" 2>&1
  echo "# bench rc=$?"
  grep -E "^#|^\|" "$OUT/bench.log" | grep -v "^|---" | head -n 60
  tail -n 5 "$OUT/bench.log" | grep -v "^|" || true
fi
if has variants; then
  for v in MOEK_CUDA_NO_EARLY MOEK_CUDA_NO_PDL; do
    for m in qwen3-30b-a3b mixtral-8x7b; do
      env $v=1 timeout 60 "$B/bench/bench_moe" --only $m --tokens 1 2>&1 | grep "^| $m" | sed "s/^/$v /"
    done
  done | tee -a "$OUT/bench.log"
fi
if has ab; then
  # Builds, or one build under switches, against each other, interleaved
  # so that the card's drift falls on all alike: for each AB_CASES entry
  # (MODEL:TOKENS[:ARGS], ARGS bench_moe's, commas for spaces), the
  # AB_RUNS entries in order and then in reverse (A B .. B A), AB_ROUNDS
  # times. An AB_RUNS entry is LABEL=BENCH[,VAR=VALUE...]: a bench_moe
  # (relative to the repository root) and switches for its environment.
  # Each line: label, model, T, tile, us, % of floor. By default this
  # build against two of its measuring switches at T = 1, 8 and 64.
  b=$B/bench/bench_moe
  read -ra runs <<<"${AB_RUNS:-main=$b notiny=$b,MOEK_CUDA_NO_TINY=1 split4=$b,MOEK_CUDA_SPLIT_MIN_KB=4}"
  order=("${runs[@]}")
  for ((i = ${#runs[@]} - 1; i >= 0; i--)); do order+=("${runs[i]}"); done
  cases=""
  for m in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    for t in 1 8 64; do cases="$cases $m:$t"; done
  done
  for c in ${AB_CASES:-$cases}; do
    IFS=: read -r m t args <<<"$c"
    for ((r = 0; r < ${AB_ROUNDS:-1}; r++)); do
      for run in "${order[@]}"; do
        IFS=, read -ra f <<<"${run#*=}"
        env "${f[@]:1}" timeout 120 "${f[0]}" --only "$m" --tokens "$t" ${args//,/ } 2>&1 |
          grep "^| $m" | awk -F'|' -v l="${run%%=*}" '{printf "%s |%s|%s|%s|%s|%s|\n", l, $2, $3, $4, $5, $7}'
      done
    done
  done | tee -a "$OUT/ab.log"
fi
if has ncu; then
  # Per-kernel device time of one forward (ncu; NCU_TOKENS tokens).
  for m in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    for t in ${NCU_TOKENS:-1}; do
      echo "# ncu $m T=$t"
      timeout 120 $NCU --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum -k regex:"route|align|gemm|finalize" -c 12 \
        "$B/bench/bench_moe" --only $m --tokens $t 2>&1 |
        awk '/^  [^ ].*\(/ {n=($1=="void"?$2:$1); sub(/\(.*/,"",n)} /gpu__time_duration.sum/ {print n, $(NF-1), $NF}' | tail -n 6
    done
  done | tee -a "$OUT/ncu.log"
fi
if has bound; then
  # What binds the GEMMs of the first forward of each BOUND_CASES entry
  # (MODEL:TOKENS[:ARGS], as AB_CASES), each GEMM alone: the summary
  # lines here, the whole report in $OUT/bound.log (RESULTS.md, run 54).
  for c in ${BOUND_CASES:-qwen3-30b-a3b:4096}; do
    IFS=: read -r m t args <<<"$c"
    echo "# bound $m T=$t $args"
    timeout 300 $NCU --cache-control none --clock-control none \
      --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
      --section WarpStateStats \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
      -k regex:gemm_wgmma -c 2 "$B/bench/bench_moe" --only "$m" --tokens "$t" \
      ${args//,/ } 2>&1 | tee -a "$OUT/bound.log" |
      grep -E "gemm_wgmma_kernel<|Duration|Throughput|dram__bytes|lts__t_bytes" |
      sed 's/  */ /g' | cut -c1-100
  done
fi
if has stalls; then
  # Where one GEMM's warps stall, by instruction: STALL_CASE (MODEL:TOKENS
  # [:ARGS], as AB_CASES), the gemm_wgmma launch after the first
  # STALL_SKIP of them (1: the first forward's GEMM 2), ncu's source page.
  IFS=: read -r m t args <<<"${STALL_CASE:-qwen3-30b-a3b:4096}"
  skip=${STALL_SKIP:-1}
  echo "# stalls $m T=$t $args, gemm_wgmma launch $skip"
  rm -f /tmp/moek-stalls.ncu-rep
  timeout 200 $NCU --section WarpStateStats --section SourceCounters \
    --import-source yes -k regex:gemm_wgmma -s "$skip" -c 1 -o /tmp/moek-stalls \
    "$B/bench/bench_moe" --only "$m" --tokens "$t" ${args//,/ } >"$OUT/stalls.log" 2>&1
  echo "# ncu rc=$?"
  $NCU -i /tmp/moek-stalls.ncu-rep --page source --csv --print-source sass \
    >/tmp/moek-stalls.csv 2>>"$OUT/stalls.log"
  python3 kernels/bench/stalls.py /tmp/moek-stalls.csv --top "${STALL_TOP:-40}" |
    tee -a "$OUT/stalls.log"
  gzip -c /tmp/moek-stalls.csv >"$OUT/stalls.csv.gz" # every instruction's samples
fi
if has cublas; then
  # The kernels cuBLAS runs at the T=4096 cases' own shapes (peers.py's
  # bmm reference), named and timed each alone (RESULTS.md, run 55).
  timeout 150 $NCU --metrics gpu__time_duration.sum,launch__grid_size,launch__cluster_dim_x,launch__cluster_dim_y,launch__registers_per_thread \
    -k regex:"nvjet|gemm" python3 kernels/bench/peers.py --shapes 2>&1 | tee "$OUT/cublas.log" |
    grep -E "^# |^  [^ =]|gpu__time_duration|launch__" | sed 's/  */ /g' | cut -c1-110
fi
if has peers; then
  PYTHONUNBUFFERED=1 timeout 200 python3 kernels/bench/peers.py --out "$OUT/peers.txt" \
    >"$OUT/peers.log" 2>&1
  echo "# peers rc=$?"
  tail -n 25 "$OUT/peers.log"
fi
if has test; then
  timeout 200 "$T" >"$OUT/test.log" 2>&1
  echo "# test rc=$?"
  grep -E "^(PASS|FAIL|SKIP)" "$OUT/test.log"
  grep -E "check failed|FAIL|timed out" -A2 "$OUT/test.log" | head -n 20
fi
if has sanitize; then
  # compute-sanitizer over the unit test's small cases (a release build:
  # the debug build's watchdog would trap in the tools' slow runs): memcheck
  # on SAN_CASES, racecheck and synccheck on SAN_RACE. What the tools
  # report, and which reports are the tools' own blind spots: RESULTS.md,
  # run 38.
  S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  R=$B/bench/test_cuda_kernels
  # make brings a carried or earlier build up to date (a no-op when it is)
  make -C kernels/bench BUILD="$B" -j8 test >>"$OUT/build.log" 2>&1 ||
    { echo "SANITIZE BUILD FAILED"; exit 1; }
  san() { # tool case
    timeout 120 "$S" --tool "$1" --target-processes all --print-limit 30 \
      $([ "$1" = memcheck ] && echo --leak-check no) "$R" "$2" >/tmp/san-one.log 2>&1
    echo "$1 $2: exit $?; $(grep -E '^(PASS|FAIL|SKIP)|(ERROR|RACECHECK) SUMMARY' \
      /tmp/san-one.log | tr '\n' ' ')"
    { echo "===== $1 $2"; cat /tmp/san-one.log; } >>"$OUT/san.log"
  }
  for c in ${SAN_CASES:-cuda_device refuses_unsupported rows_mapped moe_decode_slots \
      moe_dep_groups moe_every_tile moe_cluster_tiles moe_slot_rows moe_stream_k \
      moe_tile_classes moe_graph_replay grouped_gemm moe_align_chunks moe_mid_batches moe_qwen3}; do
    san memcheck "$c"
  done
  for c in ${SAN_RACE:-moe_every_tile moe_dep_groups}; do
    san racecheck "$c"
    san synccheck "$c"
  done
fi
if has report && [ -f "$OUT/ours.csv" ]; then
  python3 kernels/bench/report.py "$OUT/ours.csv" "$OUT/peers.txt" | tee "$OUT/report.md"
fi
