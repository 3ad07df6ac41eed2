#!/usr/bin/env bash
# Per-fusion A/B on one GPU (bundle/ from `cargo xtask gpu-bundle`): the CUDA and fusion GPU
# tests first, then `ferrum bench` TP1 with every fusion (FERRUM_FUSE=1) against
# FERRUM_FUSE=${B_FUSE:-merge,norms} (RoPE in its own kernel), alternating (gpu-env-ab.sh).
set -u
export NCCL_NVLS_ENABLE=0
sh bundle/unpack.sh || exit 1  # the executables come gzipped (cargo xtask gpu-bundle)
timeout 120 bundle/gpu-tests-cuda --ignored --test-threads=1 2>&1 | grep -E "^test result|FAILED" | sed 's/^/gpu-tests-cuda: /'
timeout 60 bundle/gpu-tests-tp --ignored --test-threads=1 fusions kernel_profile 2>&1 | grep -E "^test result|FAILED|bit-identical" | sed 's/^/gpu-tests-tp: /'
bash "$(dirname "$0")/gpu-env-ab.sh" FERRUM_FUSE=1 "FERRUM_FUSE=${B_FUSE:-merge,norms}"
