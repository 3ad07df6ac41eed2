#!/usr/bin/env bash
# Per-fusion A/B on one GPU (bundle/ from `cargo xtask gpu-bundle`): the CUDA and fusion GPU
# tests first, then `ferrum bench` TP1 with every fusion (FERRUM_FUSE=1) against
# FERRUM_FUSE=${B_FUSE:-merge,norms} (RoPE in its own kernel), alternating, in one call.
set -u
export NCCL_NVLS_ENABLE=0
RET=${OUT:-/tmp/ferrum-gpu-out}; mkdir -p "$RET"
timeout 120 bundle/gpu-tests-cuda --ignored --test-threads=1 2>&1 | grep -E "^test result|FAILED" | sed 's/^/gpu-tests-cuda: /'
timeout 60 bundle/gpu-tests-tp --ignored --test-threads=1 fusions kernel_profile 2>&1 | grep -E "^test result|FAILED|bit-identical" | sed 's/^/gpu-tests-tp: /'
one() {  # model, FERRUM_FUSE value, tag
    FERRUM_FUSE=$2 timeout 60 bundle/ferrum bench --device cuda --synthetic "$1" --dtype bf16 --prompt-tokens 128 \
        --gen-tokens 256 --runs 3 --json >"$RET/ab-$1-$3.json" 2>/dev/null
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['model']} FERRUM_FUSE={sys.argv[2]}: {r['decode_tok_per_s']:.0f} tok/s\")" \
        "$RET/ab-$1-$3.json" "$2"
}
B=${B_FUSE:-merge,norms}
for m in ${MODELS:-smollm2-135m llama3.2-1b llama3-8b}; do
    one "$m" 1 all1; one "$m" "$B" b1
    [ "$m" = smollm2-135m ] && { one "$m" 1 all2; one "$m" "$B" b2; }
done
