#!/usr/bin/env bash
# One full GPU round on a machine with a CUDA GPU and no Rust toolchain, from the repository
# root, with `bundle/` (from `cargo xtask gpu-bundle`) beside it. Prints a compact summary last;
# full logs go to $LOGS (default /tmp/ferrum-gpu-logs); at the end the summary, the suite and
# TP-CLI logs and every bench JSON (one file, JSON lines) are copied to $OUT (the device tool's
# return folder, which takes few files).
#
#   bash scripts/gpu-session.sh            # suite + HF checks + memcheck + benches + PyTorch peer
#   SKIP_BENCH=1 bash scripts/gpu-session.sh
#   (also SKIP_SUITE, SKIP_MEMCHECK, SKIP_TPCLI, SKIP_NOPDL, SKIP_NOFUSE, SKIP_PROFILE, SKIP_LONG,
#   SKIP_HOSTLOOP, SKIP_PEER, SKIP_TP2NCCL, SKIP_FULLHEAD; BENCH_MODELS, TP2_MODELS, PROFILE_MODELS, SUITE_EXTRA, MEMCHECK_FILTER)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
RET=${OUT:-/tmp/ferrum-gpu-out}
OUT=${LOGS:-/tmp/ferrum-gpu-logs}
mkdir -p "$OUT" "$RET"
B=bundle
sh bundle/unpack.sh || exit 1  # the executables come gzipped (cargo xtask gpu-bundle)
# The summary goes straight to $RET, so a run cut short by a time limit still returns it.
S=$RET/summary.txt
: > "$S"
say() { echo "$*" | tee -a "$S"; }

say "== machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

if [ -z "${SKIP_SUITE:-}" ]; then
# HF transformers checkpoints with random weights, saved with save_pretrained, plus their logits.
HF=/tmp/ferrum-hf
rm -rf "$HF"; mkdir -p "$HF"
for spec in "llama untied bfloat16" "mistral tied float16" "qwen2 untied bfloat16" "qwen3 tied bfloat16" \
            "qwen3 untied float32"; do
    set -- $spec
    python3 scripts/hf_random_model.py --arch "$1" --"$2" --dtype "$3" --device cuda --out "$HF/$1-$2-$3" \
        >>"$OUT/hf-models.log" 2>&1 || say "hf_random_model.py $spec FAILED (see hf-models.log)"
done

# The GPU suite: every test executable in the bundle, ignored (GPU) tests only.
FERRUM_HF_REF_ROOT=$HF timeout ${SUITE_TIMEOUT:-330} "$B/run-gpu-suite.sh" --nocapture ${SUITE_EXTRA:-} >"$OUT/gpu-suite.log" 2>&1
say "== GPU suite exit: $?"
cp "$OUT/gpu-suite.log" "$RET/" 2>/dev/null
grep -E "^(== |test result|RUNNER|HF |CUDA-|LONG|NCCL|GRAPH)|FAIL|panicked|TP2 vs|TP2 greedy|synthetic TP2|on rank" "$OUT/gpu-suite.log" \
    | cut -c1-220 | tee -a "$S"

fi
if [ -z "${SKIP_MEMCHECK:-}" ] && command -v compute-sanitizer >/dev/null; then
    # MEMCHECK_FILTER: test names to run under memcheck (default: all of gpu-tests-cuda).
    timeout ${MEMCHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --error-exitcode 9 "$B/gpu-tests-cuda" --ignored --test-threads=1 \
        ${MEMCHECK_FILTER:-} >"$OUT/memcheck.log" 2>&1
    say "== memcheck (gpu-tests-cuda) exit: $? ; $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi

GPUS=$(nvidia-smi -L | grep -c '^GPU')
if [ -z "${SKIP_TPCLI:-}" ] && [ "$GPUS" -ge 2 ]; then
    say "== ferrum generate with TP over two GPUs (scripts/gpu-tp-cli.sh)"
    timeout ${TPCLI_TIMEOUT:-200} bash scripts/gpu-tp-cli.sh >"$OUT/tp-cli.log" 2>&1
    grep -E "^(TP-CLI|tp|two)" "$OUT/tp-cli.log" | tee -a "$S"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
    TPS="1"; [ "$GPUS" -ge 2 ] && TPS="1 2"
    say "== ferrum bench (bf16, 128-token prompt, 256 new tokens, median of 3 runs; device loop, graphs)"
    for tp in $TPS; do
    models=${BENCH_MODELS:-smollm2-135m llama3.2-1b llama3-8b}
    [ "$tp" = 2 ] && models=${TP2_MODELS:-$models}
    for m in $models; do
        "$B/ferrum" bench --device cuda --tp $tp --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 256 \
            --runs 3 --json >"$OUT/bench-$m-tp$tp.json" 2>>"$OUT/bench.log"
        python3 - "$OUT/bench-$m-tp$tp.json" <<'PY' | tee -a "$S"
import json, sys
r = json.load(open(sys.argv[1]))
extra = ""
parts = []
if r.get("host_us_per_token") is not None:
    parts.append(f"host {r['host_us_per_token']:.2f} us/token")
if r.get("capture_ms") is not None:  # none when the step's graphs were captured before the timed runs
    parts.append(f"capture {r['capture_ms']:.1f} ms")
if parts:
    extra = "; " + ", ".join(parts)
print(f"ferrum {r['model']} [{r['backend']}] {r['mode']}, {r.get('lm_head', '?')} head: {r['decode_tok_per_s']:.0f} tok/s, "
      f"{r['decode_ms_per_token_median']:.3f} ms/tok (worst run {r['decode_ms_per_token_p99']:.3f}), "
      f"prefill {r['prefill_ms_median']:.1f} ms, {r['achieved_gb_per_s']:.0f} GB/s per GPU = "
      f"{100*r['share_of_copy_bandwidth']:.1f}% of copy {r['copy_gb_per_s']:.0f} GB/s{extra}")
PY
    done
    done
    # The TP1 runs again with one environment switch: ab VAR=VALUE file-suffix label "title".
    ab() {
        say "== the same TP1 runs with $1 ($4)"
        for m in ${BENCH_MODELS:-smollm2-135m llama3.2-1b llama3-8b}; do
            env "$1" "$B/ferrum" bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 256 \
                --runs 3 --json >"$OUT/bench-$m-$2.json" 2>>"$OUT/bench.log"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"ferrum {r['model']} [{r['backend']}] {sys.argv[2]}: {r['decode_tok_per_s']:.0f} tok/s, {r['decode_ms_per_token_median']:.3f} ms/tok\")" \
                "$OUT/bench-$m-$2.json" "$3" | tee -a "$S"
        done
    }
    if [ -z "${SKIP_FULLHEAD:-}" ]; then
        say "== the same TP1 runs with --full-head (the LM head's GEMV and argmax, not the screened head)"
        for m in ${BENCH_MODELS:-smollm2-135m llama3.2-1b llama3-8b}; do
            "$B/ferrum" bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 256 \
                --runs 3 --full-head --json >"$OUT/bench-$m-fullhead.json" 2>>"$OUT/bench.log"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"ferrum {r['model']} [{r['backend']}] {r['lm_head']} head: {r['decode_tok_per_s']:.0f} tok/s, {r['decode_ms_per_token_median']:.3f} ms/tok\")" \
                "$OUT/bench-$m-fullhead.json" | tee -a "$S"
        done
    fi
    [ -z "${SKIP_NOPDL:-}" ] && ab FERRUM_PDL=0 nopdl "no PDL" "no programmatic dependent launch: compute_80 PTX"
    [ -z "${SKIP_NOFUSE:-}" ] && ab FERRUM_FUSE=0 nofuse "no fusion" "every decode fusion off: split-KV merge, norms, RoPE in the attention"
    if [ -z "${SKIP_PROFILE:-}" ]; then
        say "== where a TP1 decode step's time goes (ferrum bench --kernel-profile; an event after every kernel)"
        for m in ${PROFILE_MODELS:-smollm2-135m llama3-8b}; do
            "$B/ferrum" bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 64 \
                --runs 1 --kernel-profile 2>>"$OUT/bench.log" | sed -n '/kernel profile/,$p' | head -16 | tee -a "$S"
        done
    fi
    if [ -z "${SKIP_LONG:-}" ]; then
        say "== llama3-8b TP1: prefill of 1024 tokens; decode at 8k context (7936-token prompt + 256)"
        "$B/ferrum" bench --device cuda --synthetic llama3-8b --dtype bf16 --prompt-tokens 1024 --gen-tokens 32 \
            --runs 3 --json >"$OUT/bench-llama3-8b-prefill1024.json" 2>>"$OUT/bench.log"
        timeout --foreground 150 "$B/ferrum" bench --device cuda --synthetic llama3-8b --dtype bf16 --prompt-tokens 7936 --gen-tokens 256 \
            --runs 2 --json >"$OUT/bench-llama3-8b-ctx8k.json" 2>>"$OUT/bench.log"
        for f in prefill1024 ctx8k; do
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"ferrum {r['model']} prompt {r['prompt_tokens']}: prefill {r['prefill_ms_median']:.1f} ms, decode {r['decode_tok_per_s']:.0f} tok/s\")" "$OUT/bench-llama3-8b-$f.json" | tee -a "$S"
        done
    fi
    if [ -z "${SKIP_HOSTLOOP:-}" ]; then
        say "== ferrum bench --host-loop (eager kernels, logits to the host every step), TP1"
        for m in ${BENCH_MODELS:-smollm2-135m llama3.2-1b llama3-8b}; do
            "$B/ferrum" bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 256 \
                --runs 3 --host-loop --json >"$OUT/bench-$m-host.json" 2>>"$OUT/bench.log"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"ferrum {r['model']} [{r['backend']}] {r['mode']}: {r['decode_tok_per_s']:.0f} tok/s\")" "$OUT/bench-$m-host.json" | tee -a "$S"
        done
    fi
    if [ "$GPUS" -ge 2 ] && [ -z "${SKIP_TP2NCCL:-}" ]; then
        say "== the same TP2 runs with FERRUM_ALLREDUCE=nccl (NCCL all-reduce + separate add + RMSNorm)"
        for m in ${TP2_MODELS:-${BENCH_MODELS:-smollm2-135m llama3.2-1b llama3-8b}}; do
            FERRUM_ALLREDUCE=nccl "$B/ferrum" bench --device cuda --tp 2 --synthetic "$m" --dtype bf16 --prompt-tokens 128 \
                --gen-tokens 256 --runs 3 --json >"$OUT/bench-$m-tp2nccl.json" 2>>"$OUT/bench.log"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"ferrum {r['model']} [{r['backend']}] nccl: {r['decode_tok_per_s']:.0f} tok/s, {r['decode_ms_per_token_median']:.3f} ms/tok\")" \
                "$OUT/bench-$m-tp2nccl.json" | tee -a "$S"
        done
    fi
    if [ "$GPUS" -ge 2 ]; then
        say "== all-reduce latency (NCCL and the one-shot peer kernel, 2 GPUs, in a graph and eager)"
        "$B/ferrum" bench --all-reduce --device cuda --tp 2 --hidden 4096 2>>"$OUT/bench.log" | tee -a "$S"
    fi
    for f in "$OUT"/bench-*.json; do  # early copy, in case the peer runs past a time limit
        [ -f "$f" ] && python3 -c 'import json,sys,os; print(json.dumps(dict(json.load(open(sys.argv[1])), file=os.path.basename(sys.argv[1]))))' "$f"
    done >"$RET/bench-all.jsonl" 2>/dev/null
    if [ -z "${SKIP_PEER:-}" ]; then
        if [ -f "$B/torch_decode.py" ]; then
            say "== PyTorch peer (same GPU, same command)"
            python3 "$B/torch_decode.py" smollm2_135m llama32_1b llama3_8b 2>>"$OUT/peer.log" | tee -a "$S"
            rc=${PIPESTATUS[0]}
            cp "$OUT/peer.log" "$RET/" 2>/dev/null
            [ "$rc" = 0 ] || { say "== PyTorch peer FAILED (exit $rc); the end of peer.log:"; tail -3 "$OUT/peer.log" | tee -a "$S"; }
        else
            say "== PyTorch peer NOT RUN: $B/torch_decode.py is missing (cargo xtask gpu-bundle copies ../shared/peers/torch_decode.py)"
        fi
    fi
fi
for f in "$OUT"/bench-*.json; do
    [ -f "$f" ] && python3 -c 'import json,sys,os; print(json.dumps(dict(json.load(open(sys.argv[1])), file=os.path.basename(sys.argv[1]))))' "$f"
done >"$RET/bench-all.jsonl" 2>/dev/null
cp "$OUT/gpu-suite.log" "$RET/" 2>/dev/null
[ -f "$OUT/tp-cli.log" ] && cp "$OUT/tp-cli.log" "$RET/"
echo; echo "===== SUMMARY ====="; cat "$S"
