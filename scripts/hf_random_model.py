#!/usr/bin/env python3
"""Build a tiny random-weight HF transformers model and its reference logits.

For ferrum's HF-safetensors loader and GPU tests: runs offline (no hub access) on a machine with
torch + transformers (written for torch 2.11 / transformers 5.x; 4.4x also works).

  python scripts/hf_random_model.py --arch qwen3 --untied --dtype bfloat16 --out /tmp/tiny-qwen3
  python scripts/hf_random_model.py --arch llama --tied --dtype float32 --out DIR --device cuda

Model: hidden 128, 4 heads (head_dim 32), 2 KV heads, 2 layers, intermediate 256, vocab 512,
max positions 512; qwen2 has q/k/v biases, qwen3 has q/k RMSNorm; mistral has no sliding window.
Weights are drawn on the CPU in float32 from a seeded torch.Generator (so the same --seed gives
the same weights on any machine), then cast to --dtype: linear weights N(0, 1/sqrt(fan_in)),
embeddings N(0, 0.1) (larger makes a tied model predict its input token), biases N(0, 0.1), every RMSNorm weight U(0.5, 1.5) (not all ones, so a
loader that drops or misplaces a norm gives wrong logits).

The checkpoint is saved, then reloaded with from_pretrained(dtype=...) (as any HF user would load
it: RoPE inv_freq stays float32, eager attention). HF runs it once in that dtype (the "native"
run, whose greedy tokens become fed_ids), then the reference runs on the same dtype-rounded weights
upcast exactly to float32 and computed in float32, fed the same tokens: an engine computing in
bf16/f16 is measured against float32 arithmetic, and `native_dtype_max_rel_err` records how far
PyTorch's own bf16/f16 run lands from that reference.

Run: 100 prompt ids (seeded, uniform over the vocab), one prefill, then 8 greedy decode steps with
the KV cache. Written to --out:
  config.json, model.safetensors (+ generation_config.json)     via save_pretrained(safe_serialization=True)
  reference_logits.npy   float32, shape (9, 512): row 0 = logits at the prefill's last position,
                         row k (1..8) = logits of decode step k, which fed fed_ids[k-1]
  native_logits.npy      the same rows from HF's run in the checkpoint dtype
  reference.json         prompt_ids, greedy_ids (9 = argmax of each row), fed_ids, arch, dtype,
                         tie_word_embeddings, versions, margins and a KV-cache self-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 256
VOCAB = 512
MAX_POS = 512
PROMPT_LEN = 100
DECODE_STEPS = 8

ROPE_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}
RMS_EPS = {"llama": 1e-5, "mistral": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6}


def build_config(arch: str, tied: bool):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=RMS_EPS[arch],
        hidden_act="silu",
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA[arch]}
    else:
        common["rope_theta"] = ROPE_THETA[arch]
    if arch == "llama":
        cfg = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(sliding_window=None, **common)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(use_sliding_window=False, attention_bias=False, **common)
    else:
        raise ValueError(arch)
    assert cfg.tie_word_embeddings == tied
    return cfg


def randomize(model, seed: int) -> dict:
    """Deterministic, CPU-float32-drawn weights; returns a small summary."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    counts = {"linear": 0, "embedding": 0, "bias": 0, "norm": 0}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                v = torch.rand(shape, generator=gen) + 0.5
                counts["norm"] += 1
            elif name.endswith(".bias"):
                v = torch.randn(shape, generator=gen) * 0.1
                counts["bias"] += 1
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen) * 0.1
                counts["embedding"] += 1
            elif len(shape) == 2:
                v = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                counts["linear"] += 1
            else:
                raise RuntimeError(f"unexpected parameter {name} {shape}")
            p.copy_(v.to(p.dtype))
    return counts


def save_tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE with exactly VOCAB tokens, trained on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello ferrum!",
            "Once upon a time there was a small model with random weights."] * 50
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "add_bos_token": False}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=sorted(ROPE_THETA))
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", help="tie lm_head to the embedding")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate lm_head (default)")
    ap.set_defaults(tied=False)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (where the reference runs)")
    ap.add_argument("--with-tokenizer", action="store_true",
                    help="also train a tiny byte-level BPE (tokenizer.json, vocab = the model's) so that "
                         "`ferrum generate --model DIR` can run on the folder")
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    cfg = build_config(args.arch, args.tied)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch.float32)
    if args.tied:
        model.tie_weights()
    counts = randomize(model, args.seed)
    if args.tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(dtype=dtype).save_pretrained(args.out, safe_serialization=True)
    if args.with_tokenizer:
        save_tiny_tokenizer(args.out)
    del model

    # The reference runs on the checkpoint as HF loads it (from_pretrained keeps the RoPE
    # inv_freq buffer in float32; a model merely cast with .to(bfloat16) would not).
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(args.out, attn_implementation="eager", **{dtype_kw: dtype})
    model = model.to(args.device).eval()
    if args.tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    assert next(model.parameters()).dtype == dtype

    rng = np.random.default_rng(args.seed)
    prompt = [int(x) for x in rng.integers(0, VOCAB, size=PROMPT_LEN)]

    def run(m, fed=None):
        """Prefill + DECODE_STEPS steps; feeds `fed` (teacher forcing) or its own argmax."""
        rows, greedy = [], []
        with torch.no_grad():
            out = m(input_ids=torch.tensor([prompt], device=args.device), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            for step in range(DECODE_STEPS + 1):
                rows.append(logits.cpu())
                nxt = int(logits.argmax())
                greedy.append(nxt)
                if step == DECODE_STEPS:
                    break
                tok = fed[step] if fed is not None else nxt
                out = m(input_ids=torch.tensor([[tok]], device=args.device), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
        return rows, greedy

    # HF's own run in the checkpoint dtype, kept to show how far a bf16/f16 engine lands
    # from float32 on this model.
    native_rows, native_greedy = run(model)
    # The reference: the same (dtype-rounded) weights upcast exactly to float32, computed in
    # float32, fed the native run's tokens so both see the same sequence.
    fed_native = native_greedy[:DECODE_STEPS]
    model = model.float()
    rows, greedy = run(model, fed=fed_native)
    native = torch.stack(native_rows).numpy().astype("<f4")
    with torch.no_grad():
        # Self-check: one cacheless pass over prompt + fed tokens gives the same rows.
        fed = fed_native
        full = model(input_ids=torch.tensor([prompt + fed], device=args.device), use_cache=False)
        full_rows = full.logits[0, PROMPT_LEN - 1 :].float().cpu()

    ref = torch.stack(rows).numpy().astype("<f4")
    assert ref.shape == (DECODE_STEPS + 1, VOCAB)
    assert np.isfinite(ref).all(), "non-finite logits"
    kv_diff = float(np.abs(full_rows.numpy() - ref).max())
    np.save(args.out / "reference_logits.npy", ref)
    np.save(args.out / "native_logits.npy", native)
    native_rel = float(max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(native, ref)))

    top2 = np.sort(ref, axis=1)[:, -2:]
    margins = [float(m) for m in (top2[:, 1] - top2[:, 0])]
    info = {
        "format_version": 1,
        "arch": args.arch,
        "model_type": cfg.model_type,
        "dtype": args.dtype,
        "reference_compute_dtype": "float32",
        "native_dtype_max_rel_err": native_rel,
        "tie_word_embeddings": args.tied,
        "seed": args.seed,
        "device": str(args.device),
        "config": {
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HIDDEN // HEADS,
            "num_hidden_layers": LAYERS,
            "intermediate_size": INTERMEDIATE,
            "vocab_size": VOCAB,
            "rope_theta": ROPE_THETA[args.arch],
            "rms_norm_eps": RMS_EPS[args.arch],
            "qkv_bias": args.arch == "qwen2",
            "qk_norm": args.arch == "qwen3",
        },
        "init": {
            "linear": "N(0, 1/sqrt(fan_in))",
            "embedding": "N(0, 0.1)",
            "bias": "N(0, 0.1)",
            "rmsnorm": "U(0.5, 1.5)",
            "drawn": "float32 on CPU from torch.Generator(seed), sorted by parameter name, then cast",
            "counts": counts,
        },
        "prompt_ids": prompt,
        "greedy_ids": greedy,
        "fed_ids": fed,
        "logits_file": "reference_logits.npy",
        "logits_shape": list(ref.shape),
        "logits_rows": "row 0: prefill, last prompt position; row k>=1: decode step k after feeding fed_ids[k-1]",
        "positions": [PROMPT_LEN - 1 + k for k in range(DECODE_STEPS + 1)],
        "top1_margins": margins,
        "max_abs_logit": float(np.abs(ref).max()),
        "kv_cache_vs_full_pass_max_abs_diff": kv_diff,
        "attn_implementation": "eager",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
        "command": " ".join(["python", "scripts/hf_random_model.py"] + sys.argv[1:]),
    }
    with open(args.out / "reference.json", "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print(
        f"{args.arch} tied={args.tied} {args.dtype} on {args.device}: greedy {greedy}, "
        f"native-dtype rel err {native_rel:.2e}, min margin {min(margins):.4f}, |logit|max {info['max_abs_logit']:.2f}, kv-vs-full {kv_diff:.2e} "
        f"-> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
