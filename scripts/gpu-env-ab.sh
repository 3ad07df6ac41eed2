#!/usr/bin/env bash
# A/B of environment settings on one GPU in one device call (bundle/ from `cargo xtask
# gpu-bundle`): for each model, `ferrum bench` (TP1, or --tp $TP) once per setting, the settings alternating,
# ROUNDS times (default 2). A setting is a space-separated list of VAR=VALUE, or "-" for none.
#
#   MODELS="llama3-8b" bash scripts/gpu-env-ab.sh - FERRUM_FUSED_NORMS_MAX_HIDDEN=8192
#   MODELS="smollm2-135m llama3-8b" bash scripts/gpu-env-ab.sh - FERRUM_ATTN_SPLITS=1 FERRUM_ATTN_SPLITS=2
#
# BIN=path in a setting runs that executable instead of bundle/ferrum (an older build carried
# beside the bundle, e.g. bundle/ferrum-base.gz, which unpack.sh unpacks too):
#   bash scripts/gpu-env-ab.sh BIN=bundle/ferrum-base -
#
# Each run has its own 90 s limit, in the caller's process group (timeout --foreground), so
# an outer `timeout N bash scripts/gpu-env-ab.sh` kills the run in flight too (without it the
# run went on beside the caller's next command: session 27 call 10).
#
# Prints one line per run; every run's JSON, with its setting and round added, goes to
# $OUT/ab.jsonl (one file: the device tool returns few files).
set -u
export NCCL_NVLS_ENABLE=0
RET=${OUT:-/tmp/ferrum-gpu-out}
mkdir -p "$RET"
sh bundle/unpack.sh || exit 1  # the executables come gzipped (cargo xtask gpu-bundle)

for m in ${MODELS:-smollm2-135m llama3.2-1b llama3-8b}; do
    for round in $(seq "${ROUNDS:-2}"); do
        for setting in "$@"; do
            vars=(); [ "$setting" != - ] && read -r -a vars <<<"$setting"
            bin=bundle/ferrum env=()
            for v in ${vars[@]+"${vars[@]}"}; do
                case "$v" in BIN=*) bin=${v#BIN=} ;; *) env+=("$v") ;; esac
            done
            f="$RET/ab-run.json"
            env ${env[@]+"${env[@]}"} timeout --foreground 90 "$bin" bench --device cuda --tp "${TP:-1}" --synthetic "$m" --dtype bf16 \
                --prompt-tokens "${PROMPT:-128}" --gen-tokens 256 --runs 3 --json >"$f" 2>/dev/null
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['model']} tp{sys.argv[4]} round {sys.argv[3]} [{sys.argv[2]}]: {r['decode_tok_per_s']:.0f} tok/s\")" \
                "$f" "$setting" "$round" "${TP:-1}" || echo "$m tp${TP:-1} round $round [$setting]: FAILED"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r.update(setting=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(r))" \
                "$f" "$setting" "$round" >>"$RET/ab.jsonl" 2>/dev/null
            rm -f "$f"
        done
    done
done
