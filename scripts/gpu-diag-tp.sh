#!/usr/bin/env bash
# Diagnostic: the TP2 failure-injection test alone, traced (RUST_LOG), with the thread states
# if it hangs (then /tmp/ferrum-fi-hung is left for the caller). Log: $OUT/fi.log.
set -u
export NCCL_NVLS_ENABLE=0
O=${OUT:-/tmp/ferrum-diag}; mkdir -p "$O"
B=bundle
rm -f /tmp/ferrum-fi-hung
RUST_LOG=ferrum_runner=debug,ferrum_nccl=debug,ferrum_tp=debug timeout -s KILL ${FI_TIMEOUT:-60} \
    "$B/gpu-tests-tp" --ignored --exact tp2_failure_injection --nocapture >"$O/fi.log" 2>&1 &
P=$!
for _ in $(seq 1 $(( ${FI_TIMEOUT:-60} - 5 ))); do sleep 1; kill -0 $P 2>/dev/null || break; done
if kill -0 $P 2>/dev/null; then
    touch /tmp/ferrum-fi-hung
    T=$(pgrep -f "gpu-tests-tp --ignored" | head -1)
    echo "== HUNG: thread states of $T" >>"$O/fi.log"
    for t in /proc/$T/task/*; do
        echo "$(cat $t/comm) wchan=$(cat $t/wchan 2>/dev/null) stat=$(awk '{print $3}' $t/stat)" >>"$O/fi.log"
    done
    nvidia-smi --query-gpu=index,utilization.gpu --format=csv >>"$O/fi.log"
fi
wait $P; echo "== failure injection exit: $?" >>"$O/fi.log"
grep -v "^\s*$" "$O/fi.log" | cut -c1-260 | tail -${FI_TAIL:-45}
