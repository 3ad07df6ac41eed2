#!/usr/bin/env bash
# `ferrum generate --device cuda` end to end on an HF folder made with save_pretrained (random
# weights + a tiny trained byte-level BPE), against `--device cpu --dtype f32` on the same folder.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
sh bundle/unpack.sh || exit 1  # the executables come gzipped (cargo xtask gpu-bundle)
M=/tmp/ferrum-cli-model
rm -rf $M
python3 scripts/hf_random_model.py --arch qwen2 --untied --dtype bfloat16 --with-tokenizer --device cuda --out $M 2>&1 | tail -1
for dev in "cuda bf16" "cuda f16" "cpu f32"; do
    set -- $dev
    echo "== ferrum generate --device $1 --dtype $2"
    bundle/ferrum generate --model $M --device "$1" --dtype "$2" --max-tokens 16 --dump-logits /tmp/l-$1-$2.npy "Hello world, once upon a time"
    echo "(exit $?)"
done
python3 - <<'PY'
import numpy as np
c = np.load("/tmp/l-cpu-f32.npy")
for name in ["cuda-bf16", "cuda-f16"]:
    g = np.load(f"/tmp/l-{name}.npy")
    n = min(len(c), len(g))
    same = 0
    while same < n and g[same].argmax() == c[same].argmax():
        same += 1
    # Rows up to and including the first divergence saw the same inputs.
    k = min(n, same + 1)
    rel = max(np.linalg.norm(g[i] - c[i]) / np.linalg.norm(c[i]) for i in range(k))
    print(f"{name} vs cpu f32: {same}/{n} greedy tokens identical; max rel err over the shared rows {rel:.2e}")
PY
echo "== bad input"
bundle/ferrum generate --model $M --device cuda:7 "hi"; echo "(exit $?)"
bundle/ferrum generate --model $M --device cuda --dtype f32 "hi"; echo "(exit $?)"
bundle/ferrum generate --model $M --device cuda --tp 2 "hi"; echo "(exit $?)"
