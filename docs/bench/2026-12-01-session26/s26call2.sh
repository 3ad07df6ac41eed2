#!/usr/bin/env bash
# session 26 call 2 (nvidia-h200): ferrum-cuda GPU tests with the exact-stripe split-K default;
# timelines with phase stamps (135M, 1B); A/B default vs FERRUM_GEMV_KS_EXACT=0 (135M, 1B, 8B)
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for spec in "smollm2-135m -" "llama3.2-1b -"; do
  set -- $spec; m=$1
  RUST_LOG=ferrum_cuda=debug timeout 100 bundle/ferrum-tl bench --device cuda --synthetic $m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call2-tl-$m.txt 2>&1
  echo "=== $m"; grep -E "decode speed|variant chosen" $OUT/call2-tl-$m.txt | sed 's/\x1b\[[0-9;]*m//g; s/.*variant chosen/chosen/' | cut -c1-140
  sed -n '/one middle layer/,/every kernel/p' $OUT/call2-tl-$m.txt | grep -v "every kernel"
done
MODELS="smollm2-135m" ROUNDS=3 timeout 150 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_KS_EXACT=0
MODELS="llama3.2-1b" ROUNDS=1 timeout 60 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_KS_EXACT=0
MODELS="llama3-8b" ROUNDS=1 timeout 80 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_KS_EXACT=0
cp $OUT/ab.jsonl $OUT/call2-ab.jsonl 2>/dev/null
timeout 230 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture > $OUT/call2-tests.txt 2>&1
grep -E "^test |EXACT-KS|test result|FAIL|panicked" $OUT/call2-tests.txt | cut -c1-160
