#!/usr/bin/env bash
# session 27 call 10 (nvidia-h200): branch exp/gqa-refill-before-wait (the refill issued before
# the wait: stages - 1 tiles in flight while a tile lands) — its stages test, then 8k A/B
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
MODELS="llama3.2-1b" PROMPT=7936 ROUNDS=1 timeout 60 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base BIN=bundle/ferrum-main - FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_STAGES=4 FERRUM_ATTN_TC_STAGES=3
MODELS="llama3-8b" PROMPT=7936 ROUNDS=1 timeout 70 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-main - FERRUM_ATTN_TC_STAGES=4
cp $OUT/ab.jsonl $OUT/call10-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
timeout 50 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture tensor_core_attention_stages > $OUT/call10-tests.txt 2>&1
grep -E "^test |test result|FAIL|panicked|not bit" $OUT/call10-tests.txt | cut -c1-170; tail -2 $OUT/call10-tests.txt
