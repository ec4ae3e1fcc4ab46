#!/bin/sh
# tests/gpu/carry.sh: build moed, moectl, the GPU tests and the several-GPU
# benchmark here and gather them with the shared libraries they need into
# .carry/ (ignored by git), so a GPU machine without libzmq or protobuf-c
# can run them:
#   tests/gpu/carry.sh && <on the GPU machine> tests/gpu/service.sh
set -eu
cd "$(dirname "$0")/../.."
ITESTS="itest_service itest_batch itest_badinput itest_shard itest_tune"
make -j"$(nproc)" all $(for t in $ITESTS; do printf 'build/tests/%s ' "$t"; done)
make -C kernels/bench BUILD="$PWD/build-bench" -j"$(nproc)" ep test
rm -rf .carry
mkdir -p .carry/bin .carry/lib .carry/tests
cp build/moed build/moectl build-bench/bench/bench_ep .carry/bin/
cp build-bench/bench/test_cuda_kernels .carry/tests/
for t in $ITESTS; do cp "build/tests/$t" .carry/tests/; done
bundle=${BUNDLE_LIBS:-../shared/tools/bundle-libs}
"$bundle" .carry/lib .carry/bin/* .carry/tests/*
# The GPU machine's own C library must serve its own resolver.
rm -f .carry/lib/libresolv.so.2
du -sh .carry
