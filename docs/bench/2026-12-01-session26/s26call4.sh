#!/usr/bin/env bash
# session 26 call 4 (nvidia-h200): the cluster merge in registers (a) and on an mbarrier with
# st.async (b = bundle/ferrum): attention GPU tests of both, a timeline of b, A/B base / a / b
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
sh bundle/unpack.sh || exit 1
T="attention_every_head_dim attention_head_dim_kernels matches_cpu_reference_all_archs long_context two_sequences argmax_and"
timeout 100 bundle/gpu-tests-cuda --ignored --test-threads=1 --nocapture $T > $OUT/call4-tests-b.txt 2>&1
echo "== b"; grep -E "^test |test result|FAIL|panicked|not bit" $OUT/call4-tests-b.txt | cut -c1-160
timeout 100 bundle/gpu-tests-cuda-a --ignored --test-threads=1 --nocapture $T > $OUT/call4-tests-a.txt 2>&1
echo "== a"; grep -E "^test |test result|FAIL|panicked|not bit" $OUT/call4-tests-a.txt | cut -c1-160
for m in smollm2-135m llama3.2-1b; do
  timeout 100 bundle/ferrum-tl bench --device cuda --synthetic $m --dtype bf16 --prompt-tokens 128 \
    --gen-tokens 256 --runs 1 --timeline 64 > $OUT/call4-tl-$m.txt 2>&1
  echo "=== $m"; grep -E "decode speed" $OUT/call4-tl-$m.txt
  sed -n '/one middle layer/,/every kernel/p' $OUT/call4-tl-$m.txt | grep -v "every kernel"
done
MODELS="smollm2-135m llama3.2-1b" ROUNDS=3 timeout 330 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base BIN=bundle/ferrum-a BIN=bundle/ferrum
MODELS="llama3-8b" ROUNDS=1 timeout 100 bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base BIN=bundle/ferrum
cp $OUT/ab.jsonl $OUT/call4-ab.jsonl 2>/dev/null
