#!/usr/bin/env bash
# `ferrum generate` with tensor parallelism on two GPUs, end to end on an HF folder made with
# save_pretrained (random weights, a tiny trained BPE): one process (--tp 2), two processes
# (--rank/--world-size with a file and a TCP rendezvous), the host loop, and TP1. Prints the
# texts and whether they agree. Needs bundle/ferrum and two GPUs.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
sh bundle/unpack.sh || exit 1  # the executables come gzipped (cargo xtask gpu-bundle)
M=/tmp/ferrum-tp-model
T=/tmp/ferrum-tp-out
rm -rf $M $T; mkdir -p $T
python3 scripts/hf_random_model.py --arch llama --untied --dtype bfloat16 --with-tokenizer --device cuda --out $M 2>&1 | tail -1
P="Once upon a time, in a land far away"
gen() { bundle/ferrum generate --model $M --max-tokens 48 "$@" "$P"; }
gen --device cuda --tp 2 >$T/tp2.txt 2>$T/tp2.err; echo "tp2 one process: exit $? | $(tail -1 $T/tp2.err)"
gen --device cuda --tp 2 --host-loop >$T/tp2-host.txt 2>$T/tp2-host.err; echo "tp2 host loop: exit $? | $(tail -1 $T/tp2-host.err)"
gen --device cuda >$T/tp1.txt 2>$T/tp1.err; echo "tp1: exit $? | $(tail -1 $T/tp1.err)"
rm -f $T/rv.id
gen --device cuda --tp 2 --rank 1 --world-size 2 --rendezvous file:$T/rv.id >$T/mp1.txt 2>$T/mp1.err &
gen --device cuda --tp 2 --rank 0 --world-size 2 --rendezvous file:$T/rv.id >$T/mp0.txt 2>$T/mp0.err
r0=$?; wait $!; r1=$?
echo "two processes (file rendezvous): exit $r0/$r1 | $(tail -1 $T/mp0.err)"
gen --device cuda --tp 2 --rank 1 --world-size 2 --rendezvous tcp:127.0.0.1:29517 >$T/tcp1.txt 2>$T/tcp1.err &
gen --device cuda --tp 2 --rank 0 --world-size 2 --rendezvous tcp:127.0.0.1:29517 >$T/tcp0.txt 2>$T/tcp0.err
r0=$?; wait $!; r1=$?
echo "two processes (tcp rendezvous): exit $r0/$r1 | $(tail -1 $T/tcp0.err)"
same() { if cmp -s "$1" "$2"; then echo "IDENTICAL"; else echo "DIFFERENT"; fi; }
echo "TP-CLI tp2 one process vs two processes (file): $(same $T/tp2.txt $T/mp0.txt)"
echo "TP-CLI tp2 one process vs two processes (tcp):  $(same $T/tp2.txt $T/tcp0.txt)"
echo "TP-CLI tp2 device loop vs host loop:            $(same $T/tp2.txt $T/tp2-host.txt)"
echo "TP-CLI tp2 vs tp1 (bf16 sums in another order): $(same $T/tp2.txt $T/tp1.txt)"
echo "TP-CLI rank 1 printed $(wc -c <$T/mp1.txt) bytes (only rank 0 prints)"
echo "--- tp2 text:"; cat $T/tp2.txt
echo "--- tp1 text:"; cat $T/tp1.txt
echo "== bad input"
bundle/ferrum generate --model $M --device cuda --tp 2 --rank 2 --world-size 2 --rendezvous file:/tmp/x "hi"; echo "(exit $?)"
bundle/ferrum generate --model $M --device cuda --tp 2 --rank 0 --world-size 2 --rendezvous bogus "hi"; echo "(exit $?)"
bundle/ferrum generate --model $M --device cuda --tp 4 "hi"; echo "(exit $?)"
