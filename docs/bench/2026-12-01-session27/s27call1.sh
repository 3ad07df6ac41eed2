#!/usr/bin/env bash
# session 27 call 1 (nvidia-h200): the tensor-core attention's stages (GPU tests + 8k A/B
# against the base build) and the GEMV tuning's tie-break (FERRUM_GEMV_TIE=0 vs default, 135M)
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem --format=csv,noheader
T="tensor_core_attention_stages long_context attention_every_head_dim"
timeout 200 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture $T > $OUT/call1-tests.txt 2>&1
grep -E "^test |test result|FAIL|panicked|not bit|TC-STAGES hd 128 bf16|LONG" $OUT/call1-tests.txt | cut -c1-170
echo "== 135M tie-break: alternating FERRUM_GEMV_TIE=0 / default"
for i in 1 2 3 4; do
  for tie in 0 5; do
    FERRUM_GEMV_TIE=$tie RUST_LOG=ferrum_cuda=debug timeout 40 bundle/ferrum bench --device cuda --synthetic smollm2-135m --dtype bf16 --prompt-tokens 128 \
      --gen-tokens 256 --runs 3 > $OUT/c.txt 2>&1
    s=$(grep -E "decode speed" $OUT/c.txt | awk '{print $3}')
    c=$(grep "variant chosen" $OUT/c.txt | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*rows=([0-9]+) cols=([0-9]+) gateup=([a-z]+) variant=GemvVariant \{ rows4: ([a-z]+), block: ([0-9]+), ks: ([0-9]+) \}.*/\1x\2:\4\/\5\/k\6/' | tr '\n' ' ')
    echo "run $i tie $tie: $s tok/s  $c"
  done
done | tee $OUT/call1-choices.txt; rm -f $OUT/c.txt
echo "== 8k: base build vs stages 2 / 3 / 4"
MODELS="llama3-8b" PROMPT=7936 ROUNDS=1 timeout 150 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_STAGES=3 FERRUM_ATTN_TC_STAGES=4
MODELS="llama3-8b" PROMPT=7936 ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh FERRUM_ATTN_TC_STAGES=5 BIN=bundle/ferrum-base FERRUM_ATTN_TC_STAGES=3
echo "== 1B / 8B short: tie default vs 0"
MODELS="llama3.2-1b llama3-8b" ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh - FERRUM_GEMV_TIE=0
cp $OUT/ab.jsonl $OUT/call1-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
