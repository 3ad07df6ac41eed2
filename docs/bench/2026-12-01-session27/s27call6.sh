#!/usr/bin/env bash
# session 27 call 6 (nvidia-h200): 1B at 8k (head dim 64) by stage count and with the old
# combine (bundle/ferrum-nocomb), against the base build; 8B 8k default vs no-combine
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
MODELS="llama3.2-1b" PROMPT=7936 ROUNDS=1 timeout 150 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base - BIN=bundle/ferrum-nocomb FERRUM_ATTN_TC_STAGES=4 FERRUM_ATTN_TC_STAGES=3 "FERRUM_ATTN_TC_STAGES=4 FERRUM_ATTN_TC_EARLY=0" "BIN=bundle/ferrum-nocomb FERRUM_ATTN_TC_STAGES=4" BIN=bundle/ferrum-base
MODELS="llama3-8b" PROMPT=7936 ROUNDS=1 timeout 80 bash scripts/gpu-env-ab.sh - BIN=bundle/ferrum-nocomb
cp $OUT/ab.jsonl $OUT/call6-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
