#!/usr/bin/env bash
# session 27 call 2 (nvidia-h200): the combine's early partial loads (bundle/ferrum, with the
# stages) vs the stages build alone and the base; 8k timelines at 2 and 5 stages
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
T="attention_every_head_dim long_context tensor_core_attention_stages"
timeout 200 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture $T > $OUT/call2-tests.txt 2>&1
grep -E "^test |test result|FAIL|panicked|not bit|LONG" $OUT/call2-tests.txt | cut -c1-170
for st in 2 5; do
  FERRUM_ATTN_TC_STAGES=$st timeout 100 bundle/ferrum-tl bench --device cuda --synthetic llama3-8b --dtype bf16 --prompt-tokens 7936 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call2-tl-8k-stages$st.txt 2>&1
  echo "=== 8k stages $st"; grep -E "decode speed" $OUT/call2-tl-8k-stages$st.txt
  sed -n '/one middle layer/,/every kernel/p' $OUT/call2-tl-8k-stages$st.txt | grep -v "every kernel"
done
MODELS="llama3-8b" PROMPT=7936 ROUNDS=2 timeout 330 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base "BIN=bundle/ferrum-stages FERRUM_ATTN_TC_STAGES=5" FERRUM_ATTN_TC_STAGES=5 FERRUM_ATTN_TC_STAGES=6 FERRUM_ATTN_TC_STAGES=4
cp $OUT/ab.jsonl $OUT/call2-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
