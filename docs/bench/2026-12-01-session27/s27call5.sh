#!/usr/bin/env bash
# session 27 call 5 (nvidia-h200): the GPU suite and the rows on the kept kernels (tie-break,
# 5-stage tensor-core attention with early tiles, the combine's early loads), the PyTorch peer;
# then 8k A/B of the attention's host settings (base build, defaults, no early tiles, 2 stages
# with carveout 44) for 8B and 1B
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
SUITE_TIMEOUT=250 SKIP_MEMCHECK=1 SKIP_TPCLI=1 SKIP_NOPDL=1 SKIP_NOFUSE=1 SKIP_HOSTLOOP=1 SKIP_TP2NCCL=1 SKIP_PROFILE=1 timeout 330 bash scripts/gpu-session.sh
mv $OUT/summary.txt $OUT/call5-summary.txt; mv $OUT/gpu-suite.log $OUT/call5-gpu-suite.log; mv $OUT/bench-all.jsonl $OUT/call5-bench-all.jsonl
grep -E "TC-STAGES hd 128 bf16 splits 64" $OUT/call5-gpu-suite.log | head -8
MODELS="llama3-8b" PROMPT=7936 ROUNDS=1 timeout 150 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base - FERRUM_ATTN_TC_EARLY=0 "FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_CARVEOUT=44" "FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_CARVEOUT=44 FERRUM_ATTN_TC_EARLY=0"
MODELS="llama3.2-1b" PROMPT=7936 ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base - FERRUM_ATTN_TC_EARLY=0 "FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_CARVEOUT=44" "FERRUM_ATTN_TC_STAGES=2 FERRUM_ATTN_TC_CARVEOUT=44 FERRUM_ATTN_TC_EARLY=0"
cp $OUT/ab.jsonl $OUT/call5-ab.jsonl 2>/dev/null; rm -f $OUT/ab.jsonl
