#!/usr/bin/env bash
# session 26 call 1 (nvidia-h200): scripts/microbench/postwait.cu; the new test of non-power-of-two
# split-K; A/B of FERRUM_GEMV_KS_EXACT (one 32-chunk stripe per warp) at 135M and 1B; timelines
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
(nvcc --version | tail -2; nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/postwait scripts/microbench/postwait.cu && timeout 120 /tmp/postwait) > $OUT/call1-postwait.txt 2>&1
cat $OUT/call1-postwait.txt
timeout 150 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture exact_stripe_splits gemv_variants_are_bit > $OUT/call1-tests.txt 2>&1
grep -E "EXACT-KS|VARIANTS|test result|FAIL|panicked" $OUT/call1-tests.txt | cut -c1-200
for spec in "smollm2-135m -" "smollm2-135m FERRUM_GEMV_KS_EXACT=6"; do
  set -- $spec; m=$1; e=$2; tag=$m; [ "$e" != - ] && tag=$m-exact
  env $( [ "$e" != - ] && echo $e ) RUST_LOG=ferrum_cuda=debug timeout 100 bundle/ferrum-tl bench --device cuda --synthetic $m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call1-tl-$tag.txt 2>&1
  echo "=== $tag"; grep -E "decode speed|variant chosen" $OUT/call1-tl-$tag.txt | sed 's/.*variant chosen/chosen/' | cut -c1-160
  sed -n '/one middle layer/,/every kernel/p' $OUT/call1-tl-$tag.txt | grep -v "every kernel"
done
MODELS="smollm2-135m" ROUNDS=3 timeout 150 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_KS_EXACT=6
MODELS="llama3.2-1b" ROUNDS=2 timeout 120 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_KS_EXACT=8
cp $OUT/ab.jsonl $OUT/call1-ab.jsonl 2>/dev/null
