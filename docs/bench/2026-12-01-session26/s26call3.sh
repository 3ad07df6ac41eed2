#!/usr/bin/env bash
# session 26 call 3 (nvidia-h200): %globaltimer's tick; timelines with the phase stamps ordered
# after their values (135M, 1B); the ferrum-cuda GPU tests (WIDE's intermediate 2560)
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
(nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/globaltimer scripts/microbench/globaltimer.cu && /tmp/globaltimer) > $OUT/call3-globaltimer.txt 2>&1
cat $OUT/call3-globaltimer.txt
for m in smollm2-135m llama3.2-1b; do
  timeout 100 bundle/ferrum-tl bench --device cuda --synthetic $m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call3-tl-$m.txt 2>&1
  echo "=== $m"; grep -E "decode speed" $OUT/call3-tl-$m.txt
  sed -n '/one middle layer/,/every kernel/p' $OUT/call3-tl-$m.txt | grep -v "every kernel"
done
timeout 230 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture > $OUT/call3-tests.txt 2>&1
grep -E "^test |EXACT-KS|VARIANTS wide |SPLITK|test result|FAIL|panicked" $OUT/call3-tests.txt | cut -c1-160
