#!/bin/sh
# tests/gpu/carry.sh: build moed, moectl and the GPU tests here and gather
# them with the shared libraries they need into .carry/ (ignored by git), so
# a GPU machine without libzmq or protobuf-c can run them:
#   tests/gpu/carry.sh && <on the GPU machine> tests/gpu/service.sh
set -eu
cd "$(dirname "$0")/../.."
make -j"$(nproc)" all build/tests/itest_service build/tests/itest_batch build/tests/itest_badinput
rm -rf .carry
mkdir -p .carry/bin .carry/lib .carry/tests
cp build/moed build/moectl .carry/bin/
cp build/tests/itest_service build/tests/itest_batch build/tests/itest_badinput .carry/tests/
bundle=${BUNDLE_LIBS:-../shared/tools/bundle-libs}
"$bundle" .carry/lib .carry/bin/moed .carry/bin/moectl .carry/tests/*
du -sh .carry
