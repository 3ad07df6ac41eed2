#!/usr/bin/env bash
# session 26 call 5 (nvidia-h200): 8 processes of 135M, each with its GEMV start-up choices (the
# 2433 of call 4's second round); the one-GPU suite with the HF transformers checks on d3f2896
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
for i in 1 2 3 4 5 6 7 8; do
  RUST_LOG=ferrum_cuda=debug timeout 40 bundle/ferrum bench --device cuda --synthetic smollm2-135m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 3 > $OUT/call5-choice-$i.txt 2>&1
  s=$(grep -E "decode speed" $OUT/call5-choice-$i.txt | awk '{print $3}')
  c=$(grep "variant chosen" $OUT/call5-choice-$i.txt | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*rows=([0-9]+) cols=([0-9]+) gateup=([a-z]+) variant=GemvVariant \{ rows4: ([a-z]+), block: ([0-9]+), ks: ([0-9]+) \}.*/\1x\2:\4\/\5\/k\6/' | tr '\n' ' ')
  echo "run $i: $s tok/s  $c"
done
SUITE_TIMEOUT=230 SKIP_BENCH=1 SKIP_MEMCHECK=1 SKIP_TPCLI=1 timeout 280 bash scripts/gpu-session.sh > $OUT/call5-session.out 2>&1
grep -E "== |test result|HF |RUNNER-REF|FAIL|panicked" $OUT/call5-session.out | cut -c1-160 | head -40
