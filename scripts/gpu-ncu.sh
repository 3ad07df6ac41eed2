#!/usr/bin/env bash
# Nsight Compute over one replayed decode step per model, on a machine with a CUDA GPU, from the
# repository root with `bundle/` beside it. `ferrum bench --profiler-range` brackets the last
# run's decode with cuProfilerStart / cuProfilerStop, and `ncu --profile-from-start off` profiles
# the first COUNT kernels after the start: the graph's kernel nodes, one at a time (ncu
# serialises them, so programmatic launch overlaps nothing: each duration is the kernel alone,
# start to end, with the L2 as the previous kernel left it).
#
#   MODELS="smollm2-135m:160 llama3.2-1b:90 llama3-8b:170" bash scripts/gpu-ncu.sh
#   DETAIL="smollm2-135m:attn llama3-8b:attn" bash scripts/gpu-ncu.sh   # + stall sections
#   MODELS= SASS="llama3-8b:attn_rope" bash scripts/gpu-ncu.sh          # warp-stall samples per SASS line
# Output: $OUT/ncu-<model>.csv (one row per kernel), $OUT/ncu-<model>-<filter>.txt and
# $OUT/sass-<model>-<filter>.csv (`--set full` on the first matching kernel, the source page).
set -u
export NCCL_NVLS_ENABLE=0
RET=${OUT:-/tmp/ferrum-gpu-out}
mkdir -p "$RET"
sh bundle/unpack.sh || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
echo "== ncu: $NCU"
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for spec in ${MODELS-smollm2-135m:160 llama3.2-1b:90 llama3-8b:170}; do
    m=${spec%:*} n=${spec#*:}
    timeout ${NCU_TIMEOUT:-200} "$NCU" --profile-from-start off --launch-count "$n" --clock-control none \
        --cache-control none --csv --page raw --metrics "$METRICS" \
        bundle/ferrum bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 16 --runs 1 \
        --profiler-range >"$RET/ncu-$m.csv" 2>"$RET/ncu-$m.err"
    echo "== ncu $m exit $? ($(grep -c '^"' "$RET/ncu-$m.csv") csv lines)"
done
for spec in ${DETAIL-}; do
    m=${spec%:*} f=${spec#*:}
    timeout ${NCU_TIMEOUT:-200} "$NCU" --profile-from-start off -k "regex:$f" --launch-count 2 --clock-control none \
        --cache-control none --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        bundle/ferrum bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 16 --runs 1 \
        --profiler-range >"$RET/ncu-$m-$f.txt" 2>&1
    echo "== ncu $m $f exit $?"
done
for spec in ${SASS-}; do
    m=${spec%:*} f=${spec#*:}
    timeout ${NCU_TIMEOUT:-200} "$NCU" --profile-from-start off -k "regex:$f" --launch-count 1 --clock-control none \
        --cache-control none --set full --import-source no -o "/tmp/ncu-$m-$f" \
        bundle/ferrum bench --device cuda --synthetic "$m" --dtype bf16 --prompt-tokens 128 --gen-tokens 16 --runs 1 \
        --profiler-range >/dev/null 2>&1
    echo "== ncu $m $f (--set full) exit $?"
    "$NCU" -i "/tmp/ncu-$m-$f.ncu-rep" --page source --csv --print-source sass >"$RET/sass-$m-$f.csv" 2>&1
done
