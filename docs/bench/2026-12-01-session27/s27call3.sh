#!/usr/bin/env bash
# session 27 call 3 (nvidia-h200): 8k timelines at 4 and 6 stages; 1B at 8k by stages;
# 135M / 1B short context by KV split count
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
for st in 4 6; do
  FERRUM_ATTN_TC_STAGES=$st timeout 100 bundle/ferrum-tl bench --device cuda --synthetic llama3-8b --dtype bf16 --prompt-tokens 7936 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call3-tl-8k-stages$st.txt 2>&1
  echo "=== 8k stages $st"; grep -E "decode speed" $OUT/call3-tl-8k-stages$st.txt
  sed -n '/one middle layer/,/every kernel/p' $OUT/call3-tl-8k-stages$st.txt | grep -v "every kernel" | grep -v phases
  grep -A8 "every kernel" $OUT/call3-tl-8k-stages$st.txt | grep -E "gqa|combine|rope" | head -3
done
MODELS="llama3.2-1b" PROMPT=7936 ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_STAGES=5 FERRUM_ATTN_TC_STAGES=6 FERRUM_ATTN_TC_STAGES=3
MODELS="smollm2-135m llama3.2-1b" ROUNDS=2 timeout 200 bash scripts/gpu-env-ab.sh - FERRUM_ATTN_SPLITS=1 FERRUM_ATTN_SPLITS=2
cp $OUT/ab.jsonl $OUT/call3-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
