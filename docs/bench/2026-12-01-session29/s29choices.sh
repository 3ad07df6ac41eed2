#!/usr/bin/env bash
# session 29: N processes of 135M (default settings), each with its GEMV start-up choices
# (rows x cols: rows4 / block threads / split-K), to find which shape's choice makes the
# slow processes (~2430 tok/s against ~2630).
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
sh bundle/unpack.sh >/dev/null || exit 1
for i in $(seq "${N:-10}"); do
  f=$OUT/choice.txt
  RUST_LOG=ferrum_cuda=debug timeout 40 bundle/ferrum bench --device cuda --synthetic "${MODEL:-smollm2-135m}" --dtype bf16 \
    --prompt-tokens 128 --gen-tokens 256 --runs 3 > "$f" 2>&1
  s=$(grep -E "decode speed" "$f" | awk '{print $3}')
  c=$(grep "variant chosen" "$f" | sed 's/\x1b\[[0-9;]*m//g' \
    | sed -E 's/.*rows=([0-9]+) cols=([0-9]+) gateup=([a-z]+) variant=GemvVariant \{ rows4: ([a-z]+), block: ([0-9]+), ks: ([0-9]+) \} us=([0-9.]+).*/\1x\2:\4\/\5\/k\6@\7/' | tr '\n' ' ')
  echo "run $i: $s tok/s  $c"
done
