#!/usr/bin/env bash
# session 27 call 4 (nvidia-h200): 8k, the tensor-core attention's carveout (is the L1 left to
# the GEMVs what made 5 stages the best?), against the base build; short rows base vs new
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
MODELS="llama3-8b" PROMPT=7936 ROUNDS=2 timeout 330 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base - FERRUM_ATTN_TC_CARVEOUT=86 "FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_CARVEOUT=44" FERRUM_ATTN_TC_CARVEOUT=100 "FERRUM_ATTN_TC_STAGES=4 FERRUM_ATTN_TC_CARVEOUT=86"
MODELS="llama3.2-1b" PROMPT=7936 ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base - "FERRUM_ATTN_TC_STAGES=6 FERRUM_ATTN_TC_CARVEOUT=86" FERRUM_ATTN_TC_CARVEOUT=100
MODELS="smollm2-135m llama3.2-1b llama3-8b" ROUNDS=1 timeout 120 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base -
cp $OUT/ab.jsonl $OUT/call4-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
