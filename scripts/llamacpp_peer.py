"""llama.cpp peer for `ferrum bench` on the CPU: the same GGUF, the same pseudo-random 128-token
prompt as `ferrum bench`, then greedy decode steps one token at a time, timed per step.

    /work/venv-llama/bin/python scripts/llamacpp_peer.py MODEL.gguf [--threads 2] [--gen 128] [--runs 3]

Needs `pip install llama-cpp-python==0.3.36` (builds llama.cpp from source; see scripts/README.md).
Prints the median decode ms/token and tok/s, and the median prefill time.
"""
import argparse
import statistics
import time

import numpy as np
from llama_cpp import Llama

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--gen", type=int, default=128)
ap.add_argument("--runs", type=int, default=3)
a = ap.parse_args()

llm = Llama(model_path=a.model, n_ctx=a.prompt + a.gen + 8, n_threads=a.threads, n_threads_batch=a.threads,
            n_batch=512, verbose=False)
vocab = llm.n_vocab()
# The prompt `ferrum bench` uses: (i * 2654435761 + 12345) mod vocab.
prompt = [(i * 2654435761 + 12345) % vocab for i in range(a.prompt)]
prefill, steps = [], []
for run in range(a.runs + 1):  # run 0 warms up
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    pf = time.perf_counter() - t
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    st = []
    for _ in range(a.gen):
        t = time.perf_counter()
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        st.append(time.perf_counter() - t)
    if run:
        prefill.append(pf)
        steps.extend(st)
med = statistics.median(steps)
print(f"llama.cpp (llama-cpp-python {__import__('llama_cpp').__version__}, {a.threads} threads): "
      f"decode {med*1e3:.3f} ms/token median = {1/med:.1f} tok/s; prefill {statistics.median(prefill)*1e3:.1f} ms "
      f"({a.prompt} tokens); {a.runs} runs x {a.gen} steps")
