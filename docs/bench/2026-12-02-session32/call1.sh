# Session 32, call 1: the LM head's first rows pinned in the L2 (FERRUM_L2_PIN_MB), A/B and timelines.
set -u
export NCCL_NVLS_ENABLE=0
sh bundle/unpack.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for v in 0 64; do
  RUST_LOG=ferrum_cuda=debug FERRUM_L2_PIN_MB=$v timeout 60 bundle/ferrum bench --device cuda --synthetic smollm2-135m --dtype bf16 --prompt-tokens 16 --gen-tokens 8 --runs 1 2>&1 | grep -o 'kernels loaded.*' | head -1 | grep -o 'l2_pin[^ ]*\|max_persist[^ ]*\|max_window[^ ]*' | tr '\n' ' '; echo
done
MODELS="smollm2-135m" ROUNDS=2 bash scripts/gpu-env-ab.sh - FERRUM_L2_PIN_MB=16 FERRUM_L2_PIN_MB=32 FERRUM_L2_PIN_MB=64
MODELS="llama3.2-1b" ROUNDS=2 bash scripts/gpu-env-ab.sh - FERRUM_L2_PIN_MB=32 FERRUM_L2_PIN_MB=64
MODELS="llama3-8b" ROUNDS=1 bash scripts/gpu-env-ab.sh - FERRUM_L2_PIN_MB=64
for v in 0 64; do
  echo "== timeline 135M FERRUM_L2_PIN_MB=$v"
  FERRUM_L2_PIN_MB=$v timeout 90 bundle/ferrum-tl bench --device cuda --synthetic smollm2-135m --dtype bf16 --prompt-tokens 128 --gen-tokens 256 --runs 1 --timeline 64 > $OUT/tl-135m-pin$v.txt 2>&1
  grep -E 'decode speed' $OUT/tl-135m-pin$v.txt; tail -6 $OUT/tl-135m-pin$v.txt
done
echo "== timeline 1B FERRUM_L2_PIN_MB=64 / 0"
for v in 0 64; do
  FERRUM_L2_PIN_MB=$v timeout 90 bundle/ferrum-tl bench --device cuda --synthetic llama3.2-1b --dtype bf16 --prompt-tokens 128 --gen-tokens 256 --runs 1 --timeline 64 > $OUT/tl-1b-pin$v.txt 2>&1
  grep -E 'decode speed' $OUT/tl-1b-pin$v.txt; tail -6 $OUT/tl-1b-pin$v.txt
done
