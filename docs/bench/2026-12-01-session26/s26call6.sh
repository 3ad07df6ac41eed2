#!/usr/bin/env bash
# session 26 call 6 (nvidia-h200): the final build (the tuning times no 96-thread split-3
# blocks): 4 processes of 135M with their GEMV choices; the one-GPU suite with the HF checks;
# the rows (135M, 1B, 8B TP1, 8k, prefill) and the PyTorch peer
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
for i in 1 2 3 4; do
  RUST_LOG=ferrum_cuda=debug timeout 40 bundle/ferrum bench --device cuda --synthetic smollm2-135m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 3 > $OUT/call6-choice-$i.txt 2>&1
  s=$(grep -E "decode speed" $OUT/call6-choice-$i.txt | awk '{print $3}')
  c=$(grep "variant chosen" $OUT/call6-choice-$i.txt | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*rows=([0-9]+) cols=([0-9]+) gateup=([a-z]+) variant=GemvVariant \{ rows4: ([a-z]+), block: ([0-9]+), ks: ([0-9]+) \}.*/\1x\2:\4\/\5\/k\6/' | tr '\n' ' ')
  echo "run $i: $s tok/s  $c"
done > $OUT/call6-choices.txt
rm -f $OUT/call6-choice-*.txt; cat $OUT/call6-choices.txt
SUITE_TIMEOUT=250 SKIP_MEMCHECK=1 SKIP_TPCLI=1 SKIP_NOPDL=1 SKIP_NOFUSE=1 SKIP_HOSTLOOP=1 SKIP_TP2NCCL=1 SKIP_PROFILE=1 \
  timeout 420 bash scripts/gpu-session.sh > $OUT/call6-session.out 2>&1
sed -n '/SUMMARY/,$p' $OUT/call6-session.out | grep -vE "^RUNNER-REF|^REF " | cut -c1-170 | head -60
