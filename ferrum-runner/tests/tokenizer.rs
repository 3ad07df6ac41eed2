//! Tokenizer and chat-template tests: tiny synthetic GGUF vocabularies (byte-level BPE and
//! SentencePiece), the streaming decoder property, special tokens, HF directories, chat
//! templates, and the real SmolLM2 vocabulary against the reference fixture.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use ferrum_runner::chat::{render_chat, ChatMessage};
use ferrum_runner::tokenizer::{byte_level_alphabet, Tokenizer};
use ferrum_runner::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// -------------------------------------------------------------------------------------------
// Synthetic vocabularies
// -------------------------------------------------------------------------------------------

fn string(s: &str) -> Value {
    Value::String(s.to_string())
}

fn strings(v: &[String]) -> Value {
    Value::Array(v.iter().map(|s| Value::String(s.clone())).collect())
}

fn spell(bytes: &[u8]) -> String {
    let alphabet = byte_level_alphabet();
    bytes.iter().map(|&b| alphabet[b as usize]).collect()
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Merges of a tiny byte-level BPE vocabulary, as raw byte pairs. Several merged tokens end in
/// the middle of a UTF-8 character (東 = E6 9D B1, 🎉 = F0 9F 8E 89), as in real vocabularies.
fn gpt2_merge_pairs() -> Vec<(Vec<u8>, Vec<u8>)> {
    let p = |a: &[u8], b: &[u8]| (a.to_vec(), b.to_vec());
    vec![
        p(b" ", b"t"),
        p(b"h", b"e"),
        p(b" t", b"he"),
        p(b"l", b"l"),
        p(b"he", b"ll"),
        p(b"hell", b"o"),
        p(b" ", b"w"),
        p(b"o", b"r"),
        p(b" w", b"or"),
        p(b"l", b"d"),
        p(b" wor", b"ld"),
        p(b"2", b"0"),
        p(b"20", b"2"),
        p(b"202", b"4"),
        p(&[0xC3], &[0xA9]),      // é
        p(b"Caf", &[0xC3, 0xA9]), // needs "Caf"
        p(b"C", b"a"),
        p(b"Ca", b"f"),
        p(&[0xE6], &[0x9D]),       // first two bytes of 東
        p(&[0xF0], &[0x9F]),       // first two bytes of 🎉
        p(&[0xF0, 0x9F], &[0x8E]), // first three bytes of 🎉
        p(b" ", &[0xE2]),          // " " + first byte of —
    ]
}

/// GGUF metadata of a tiny byte-level BPE vocabulary: 3 control tokens, the 256 byte
/// characters, then one token per merge.
fn gpt2_metadata(pre: &str, add_bos: Option<bool>) -> HashMap<String, Value> {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3i32; SPECIALS.len()];
    tokens.extend(byte_level_alphabet().iter().map(|c| c.to_string()));
    types.extend(std::iter::repeat_n(1, 256));
    let mut merges = Vec::new();
    for (a, b) in gpt2_merge_pairs() {
        let merged = spell(&[a.clone(), b.clone()].concat());
        merges.push(format!("{} {}", spell(&a), spell(&b)));
        if !tokens.contains(&merged) {
            tokens.push(merged);
            types.push(1);
        }
    }
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), string("gpt2"));
    md.insert("tokenizer.ggml.pre".into(), string(pre));
    md.insert("tokenizer.ggml.tokens".into(), strings(&tokens));
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect()));
    md.insert("tokenizer.ggml.merges".into(), strings(&merges));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    if let Some(b) = add_bos {
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(b));
    }
    md
}

fn tiny_gpt2() -> Tokenizer {
    Tokenizer::from_gguf_metadata(&gpt2_metadata("smollm", Some(false))).unwrap()
}

/// GGUF metadata of a tiny SentencePiece (`llama`) vocabulary: `<unk>`, `<s>`, `</s>`, 256
/// byte-fallback tokens, then pieces with scores (no merges: they come from the scores).
fn spm_metadata() -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2i32, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces: &[(&str, f32)] = &[
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -3.0),
        ("l", -4.0),
        ("o", -5.0),
        ("w", -6.0),
        ("r", -7.0),
        ("d", -8.0),
        ("c", -8.5),
        ("a", -8.6),
        ("f", -8.7),
        ("é", -8.8),
        ("he", -10.0),
        ("ll", -11.0),
        ("▁he", -12.0),
        ("llo", -13.0),
        ("▁hello", -14.0),
        ("▁w", -15.0),
        ("or", -16.0),
        ("▁wor", -17.0),
        ("ld", -18.0),
        ("▁world", -19.0),
        ("ca", -20.0),
        ("caf", -21.0),
        ("▁caf", -22.0),
        ("▁café", -23.0),
    ];
    for (p, s) in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(*s);
    }
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), string("llama"));
    md.insert("tokenizer.ggml.tokens".into(), strings(&tokens));
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect()));
    md.insert("tokenizer.ggml.scores".into(), Value::Array(scores.into_iter().map(Value::F32).collect()));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    md.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(0));
    md
}

fn tiny_spm() -> Tokenizer {
    Tokenizer::from_gguf_metadata(&spm_metadata()).unwrap()
}

fn stream_all(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut dec = if skip_special { tok.stream_decoder_skip_special() } else { tok.stream_decoder() };
    let mut pieces = Vec::new();
    for &id in ids {
        if let Some(p) = dec.step(id).unwrap() {
            pieces.push(p);
        }
    }
    if let Some(p) = dec.flush().unwrap() {
        pieces.push(p);
    }
    let joined = pieces.concat();
    (pieces, joined)
}

const SAMPLES: &[&str] = &[
    "hello world",
    " the hello world 2024",
    "Café naïve — 東京 🎉",
    "東東🎉🎉 — x",
    "line one\nline two\n\n  indented\ttab",
    "",
    " ",
    "2024-01-02: 3.14159 x 100000",
    "don't we'll it's",
];

// -------------------------------------------------------------------------------------------
// Byte-level BPE
// -------------------------------------------------------------------------------------------

#[test]
fn gpt2_roundtrip_and_merges() {
    let tok = tiny_gpt2();
    assert_eq!(tok.vocab_size(), 3 + 256 + gpt2_merge_pairs().len());
    for s in SAMPLES {
        let ids = tok.encode(s, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), *s, "{s:?} -> {ids:?}");
    }
    let ids = tok.encode("hello world", false).unwrap();
    let strs: Vec<String> = ids.iter().map(|&i| tok.token_str(i).unwrap()).collect();
    assert_eq!(strs, ["hello", "Ġworld"]);
    // é merges into one token, 東 into a two-byte token (mid-character) plus one byte.
    let ids = tok.encode("Café東", false).unwrap();
    let strs: Vec<String> = ids.iter().map(|&i| tok.token_str(i).unwrap()).collect();
    assert_eq!(strs, [spell("Café".as_bytes()), spell(&[0xE6, 0x9D]), spell(&[0xB1])]);
}

#[test]
fn special_tokens_are_single_ids() {
    let tok = tiny_gpt2();
    let text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "{ids:?}");
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(100));
    assert_eq!(tok.decode_skip_special(&ids).unwrap(), "user\nhello\nassistant\n");
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
}

#[test]
fn smollm_pre_splits_digits_gpt2_does_not() {
    let smol = Tokenizer::from_gguf_metadata(&gpt2_metadata("smollm", None)).unwrap();
    let gpt2 = Tokenizer::from_gguf_metadata(&gpt2_metadata("gpt2", None)).unwrap();
    assert_eq!(smol.encode("2024", false).unwrap().len(), 4);
    assert_eq!(gpt2.encode("2024", false).unwrap().len(), 1);
    // Unknown pre values fall back to GPT-2 (with a warning), like llama.cpp.
    let other = Tokenizer::from_gguf_metadata(&gpt2_metadata("no-such-pre", None)).unwrap();
    assert_eq!(other.encode("2024", false).unwrap(), gpt2.encode("2024", false).unwrap());
    // Llama 3 / Qwen2 regexes build and round-trip.
    for pre in ["llama-bpe", "qwen2", "qwen35", "tekken", "llama4", "starcoder", "default"] {
        let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata(pre, None)).unwrap();
        for s in SAMPLES {
            assert_eq!(tok.decode(&tok.encode(s, false).unwrap()).unwrap(), *s, "{pre}: {s:?}");
        }
    }
}

#[test]
fn bos_follows_metadata() {
    // smollm, no add_bos_token key: no BOS (llama.cpp's default for byte-level BPE).
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("smollm", None)).unwrap();
    assert!(!tok.add_bos());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.encode("hello", true).unwrap(), tok.encode("hello", false).unwrap());
    // Explicit add_bos_token.
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("smollm", Some(true))).unwrap();
    assert!(tok.add_bos());
    let ids = tok.encode("hello", true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(&ids[1..], tok.encode("hello", false).unwrap());
    assert_eq!(tok.encode("", true).unwrap(), [1]);
    // Llama 3 pre-tokenizer: BOS by default.
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("llama-bpe", None)).unwrap();
    assert!(tok.add_bos());
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("llama-bpe", Some(false))).unwrap();
    assert!(!tok.add_bos());
    // add_eos_token.
    let mut md = gpt2_metadata("smollm", Some(false));
    md.insert("tokenizer.ggml.add_eos_token".into(), Value::Bool(true));
    let tok = Tokenizer::from_gguf_metadata(&md).unwrap();
    assert!(tok.add_eos());
    assert_eq!(*tok.encode("hello", true).unwrap().last().unwrap(), 2);
}

#[test]
fn eos_ids_include_end_of_turn_tokens() {
    let tok = tiny_gpt2();
    // eos_token_id first, then <|endoftext|> (and <|im_end|>, already there).
    assert_eq!(tok.eos_ids(), [2, 0]);
    assert!(tok.is_eos(0) && tok.is_eos(2) && !tok.is_eos(1));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
}

#[test]
fn bad_metadata_is_a_typed_error() {
    let mut md = gpt2_metadata("smollm", None);
    md.remove("tokenizer.ggml.model");
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));
    let mut md = gpt2_metadata("smollm", None);
    md.insert("tokenizer.ggml.model".into(), string("bert"));
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));
    let mut md = gpt2_metadata("smollm", None);
    md.remove("tokenizer.ggml.merges");
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));
    let mut md = gpt2_metadata("smollm", None);
    md.insert("tokenizer.ggml.tokens".into(), Value::U32(3));
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));
    let mut md = gpt2_metadata("smollm", None);
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(vec![Value::I32(1)]));
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));

    let tok = tiny_gpt2();
    let n = tok.vocab_size() as u32;
    assert!(matches!(tok.decode(&[5, n]), Err(Error::TokenOutOfRange { token, .. }) if token == n));
    assert!(tok.stream_decoder().step(n).is_err());
}

// -------------------------------------------------------------------------------------------
// SentencePiece (llama) vocabularies
// -------------------------------------------------------------------------------------------

#[test]
fn spm_encode_decode() {
    let tok = tiny_spm();
    assert!(tok.add_bos(), "SentencePiece vocabularies add BOS by default");
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), [2]);
    let ids = tok.encode("hello world", false).unwrap();
    let strs: Vec<String> = ids.iter().map(|&i| tok.token_str(i).unwrap()).collect();
    assert_eq!(strs, ["▁hello", "▁world"]);
    assert_eq!(tok.encode("hello world", true).unwrap(), [[1].as_slice(), &ids].concat());
    // Characters outside the vocabulary fall back to bytes.
    let ids = tok.encode("東", false).unwrap();
    let strs: Vec<String> = ids.iter().map(|&i| tok.token_str(i).unwrap()).collect();
    assert_eq!(strs, ["▁", "<0xE6>", "<0x9D>", "<0xB1>"]);
    for s in ["hello world", "café hello", "東京 🎉 x", "hello  world", "a\nb"] {
        let ids = tok.encode(s, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), s, "{s:?} -> {ids:?}");
    }
    // <s> in text is the control token.
    let ids = tok.encode("<s>hello", false).unwrap();
    assert_eq!(ids[0], 1);
}

// -------------------------------------------------------------------------------------------
// Streaming decode
// -------------------------------------------------------------------------------------------

fn check_stream_property(tok: &Tokenizer, seed: u64, rounds: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = tok.vocab_size() as u32;
    for round in 0..rounds {
        let len = rng.random_range(0..40);
        // Bias towards low ids (specials, bytes) to get plenty of partial characters.
        let ids: Vec<u32> = (0..len)
            .map(|_| if rng.random_bool(0.5) { rng.random_range(0..n.min(300)) } else { rng.random_range(0..n) })
            .collect();
        for skip in [false, true] {
            let (_, joined) = stream_all(tok, &ids, skip);
            let expected = if skip { tok.decode_skip_special(&ids) } else { tok.decode(&ids) }.unwrap();
            assert_eq!(joined, expected, "round {round}, skip_special {skip}, ids {ids:?}");
        }
    }
}

#[test]
fn stream_decoder_matches_decode_on_random_ids() {
    check_stream_property(&tiny_gpt2(), 1, 3000);
    check_stream_property(&tiny_spm(), 2, 3000);
}

#[test]
fn stream_decoder_emits_whole_characters() {
    for tok in [tiny_gpt2(), tiny_spm()] {
        let text = "Café naïve — 東京 🎉";
        let ids = tok.encode(text, false).unwrap();
        let mut dec = tok.stream_decoder();
        let mut pieces = Vec::new();
        let mut held_back = 0;
        for &id in &ids {
            match dec.step(id).unwrap() {
                Some(p) => pieces.push(p),
                None => held_back += 1,
            }
        }
        pieces.extend(dec.flush().unwrap());
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "{p:?}");
        }
        assert_eq!(pieces.concat(), text);
        assert!(held_back > 0, "some token should end mid-character: {ids:?}");
        // The decoder is reusable after flush.
        let (_, again) = stream_all(&tok, &ids, false);
        assert_eq!(again, text);
    }
}

#[test]
fn stream_decoder_flushes_unfinished_character() {
    let tok = tiny_gpt2();
    let ids = tok.encode("a東", false).unwrap();
    let mut dec = tok.stream_decoder();
    let mut out = String::new();
    for &id in &ids[..ids.len() - 1] {
        out.extend(dec.step(id).unwrap());
    }
    assert_eq!(out, "a");
    assert_eq!(dec.flush().unwrap().as_deref(), Some("\u{FFFD}"));
    assert_eq!(tok.decode(&ids[..ids.len() - 1]).unwrap(), "a\u{FFFD}");
}

// -------------------------------------------------------------------------------------------
// HF directories
// -------------------------------------------------------------------------------------------

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

#[test]
fn hf_dir_with_config_files() {
    let dir = tempfile::tempdir().unwrap();
    let json = tiny_gpt2().inner().to_string(false).unwrap();
    write(dir.path(), "tokenizer.json", &json);
    write(
        dir.path(),
        "tokenizer_config.json",
        r#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": true},
            "add_bos_token": true, "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}"#,
    );
    write(dir.path(), "generation_config.json", r#"{"eos_token_id": [2, 0]}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(format!("{tok:?}").contains("ByteLevel"), "{tok:?}");
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), [2, 0]);
    assert!(tok.add_bos());
    assert_eq!(tok.encode("hello", true).unwrap()[0], 1);
    assert_eq!(tok.encode("hello world", false).unwrap(), tiny_gpt2().encode("hello world", false).unwrap());
    let rendered = tok.apply_chat_template(&[ChatMessage::user("hi")], true).unwrap();
    assert_eq!(rendered, "<|im_start|>hi");
    check_stream_property(&tok, 3, 300);
}

#[test]
fn hf_dir_post_processor_decides_bos() {
    let dir = tempfile::tempdir().unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&tiny_spm().inner().to_string(false).unwrap()).unwrap();
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
    });
    write(dir.path(), "tokenizer.json", &json.to_string());
    write(dir.path(), "tokenizer_config.json", r#"{"bos_token": "<s>", "eos_token": "</s>"}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(format!("{tok:?}").contains("Spm { strip: true }"), "{tok:?}");
    assert!(tok.add_bos());
    assert_eq!(tok.encode("hello world", true).unwrap(), tiny_spm().encode("hello world", true).unwrap());
    assert_eq!(tok.chat_template(), None);
    let err = tok.apply_chat_template(&[ChatMessage::user("hi")], true).unwrap_err();
    assert!(matches!(&err, Error::ChatTemplate(m) if m.contains("no chat template")), "{err}");
    check_stream_property(&tok, 4, 300);

    let missing = tempfile::tempdir().unwrap();
    assert!(matches!(Tokenizer::from_hf_dir(missing.path()), Err(Error::Io { .. })));
}

// -------------------------------------------------------------------------------------------
// Chat templates
// -------------------------------------------------------------------------------------------

/// SmolLM2-Instruct's chat template (`tokenizer.chat_template` of the default model).
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Meta-Llama-3-8B-Instruct's chat template.
const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

#[test]
fn smollm2_template() {
    let out = render_chat(SMOLLM2_TEMPLATE, &[ChatMessage::user("What is 2+2?")], true, "<|im_start|>", "<|im_end|>")
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let msgs = [ChatMessage::system("Be brief."), ChatMessage::user("Hi"), ChatMessage::assistant("Hello!")];
    let out = render_chat(SMOLLM2_TEMPLATE, &msgs, false, "", "").unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    );
    // Rendered specials tokenize to single ids.
    let tok = tiny_gpt2();
    let ids = tok.encode(&out, false).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 3);
}

#[test]
fn llama3_template() {
    let msgs = [ChatMessage::system("  You are terse.  "), ChatMessage::user("Hi\n")];
    let out = render_chat(LLAMA3_TEMPLATE, &msgs, true, "<|begin_of_text|>", "<|eot_id|>").unwrap();
    assert_eq!(
        out,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn template_python_methods_and_block_trimming() {
    let template = "{% for m in messages %}\n  {% if m['content'].strip().startswith('/') %}\n[cmd:{{ m.content.strip()[1:] | upper }}]\n  {% else %}\n{{ m.role.title() }}: {{ m['content'].strip() }}\n  {% endif %}\n{% endfor %}";
    let msgs = [ChatMessage::user("  /reset "), ChatMessage::assistant(" ok ")];
    let out = render_chat(template, &msgs, false, "", "").unwrap();
    assert_eq!(out, "[cmd:RESET]\nAssistant: ok\n");
    let dated = render_chat("{{ strftime_now('%Y') | length }}", &[], false, "", "").unwrap();
    assert_eq!(dated, "4");
}

#[test]
fn template_errors_are_typed() {
    let alternating = "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ message['content'] }}{% endfor %}";
    let ok = render_chat(alternating, &[ChatMessage::user("a"), ChatMessage::assistant("b")], false, "", "").unwrap();
    assert_eq!(ok, "ab");
    let err = render_chat(alternating, &[ChatMessage::user("a"), ChatMessage::user("b")], false, "", "").unwrap_err();
    match &err {
        Error::ChatTemplate(m) => assert!(m.contains("Conversation roles must alternate"), "{m}"),
        other => panic!("expected a chat-template error, got {other:?}"),
    }
    assert!(matches!(render_chat("{% for %}", &[], false, "", ""), Err(Error::ChatTemplate(_))));
    assert!(matches!(render_chat("  ", &[], false, "", ""), Err(Error::ChatTemplate(_))));
}

#[test]
fn template_resources_are_bounded() {
    // 10^7 loop steps: seconds of work without an instruction budget, an error at once with one.
    let spin = "{% for i in range(10000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}";
    let t = Instant::now();
    let err = render_chat(spin, &[ChatMessage::user("hi")], false, "", "").unwrap_err();
    assert!(matches!(&err, Error::ChatTemplate(m) if m.contains("instruction budget")), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    // 10 MB of output from a few hundred instructions.
    let flood = "{% for i in range(100) %}{{ 'x' * 100000 }}{% endfor %}";
    let err = render_chat(flood, &[ChatMessage::user("hi")], false, "", "").unwrap_err();
    assert!(matches!(&err, Error::ChatTemplate(m) if m.contains("more than")), "{err}");
    // The output budget grows with the messages: a long prompt still renders whole.
    let long = "y".repeat(3 << 20);
    let echo = "{% for m in messages %}{{ m.content }}{% endfor %}";
    assert_eq!(render_chat(echo, &[ChatMessage::user(long.clone())], false, "", "").unwrap(), long);
}

// -------------------------------------------------------------------------------------------
// Hostile vocabularies and configs
// -------------------------------------------------------------------------------------------

/// Writes `md` (plus `extra`) as a GGUF file with no tensors.
fn write_metadata_gguf(path: &Path, md: &HashMap<String, Value>, extra: &[(&str, Value)]) {
    let mut entries: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    entries.extend(extra.iter().map(|(k, v)| (*k, v)));
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &entries, &[]).unwrap();
}

#[test]
fn gguf_tokenizer_file_goes_through_the_header_checks() {
    let dir = tempfile::tempdir().unwrap();
    let md = gpt2_metadata("smollm", Some(false));
    let good = dir.path().join("good.gguf");
    write_metadata_gguf(&good, &md, &[]);
    assert_eq!(Tokenizer::from_gguf_file(&good).unwrap().vocab_size(), tiny_gpt2().vocab_size());
    // candle divides by general.alignment: 0 must be refused before candle parses the file.
    let zero = dir.path().join("zero.gguf");
    write_metadata_gguf(&zero, &md, &[("general.alignment", Value::U32(0))]);
    let err = Tokenizer::from_gguf_file(&zero).unwrap_err();
    assert!(matches!(&err, Error::Corrupt { detail, .. } if detail.contains("alignment")), "{err}");
    let missing = dir.path().join("missing.gguf");
    assert!(matches!(Tokenizer::from_gguf_file(&missing), Err(Error::Io { .. })));
}

#[test]
fn huge_token_ids_are_rejected() {
    // The tables are sized by the largest id: 2^32 - 1 made the size 2^32, which truncated to
    // an empty table (and a panic on the first decoded id); 2^32 - 2 asked for 96 GiB.
    let base: serde_json::Value = serde_json::from_str(&tiny_gpt2().inner().to_string(false).unwrap()).unwrap();
    for id in [u64::from(u32::MAX), u64::from(u32::MAX) - 1, 1 << 22] {
        let mut json = base.clone();
        json["model"]["vocab"]["zz"] = id.into();
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &json.to_string());
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, Error::Tokenizer(m) if m.contains("past the limit")), "id {id}: {err}");
    }
    // The largest id the limit allows loads.
    let mut json = base;
    json["model"]["vocab"]["zz"] = ((1u64 << 22) - 1).into();
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tokenizer.json", &json.to_string());
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.vocab_size(), 1 << 22);
    assert_eq!(tok.decode(&[(1 << 22) - 1, 3]).unwrap(), "zz\u{0}");
}

#[test]
fn ids_that_do_not_fit_are_errors_not_truncated() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tokenizer.json", &tiny_gpt2().inner().to_string(false).unwrap());
    // 2^32 + 2 would truncate to 2, a real EOS id.
    for ids in ["4294967298", "[2, 4294967298]"] {
        write(dir.path(), "generation_config.json", &format!(r#"{{"eos_token_id": {ids}}}"#));
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, Error::Tokenizer(m) if m.contains("eos_token_id")), "{ids}: {err}");
    }
    // A BOS id that fits a u32 but not the vocabulary, added to every text, is an error ...
    write(dir.path(), "generation_config.json", r#"{"bos_token_id": 100000, "eos_token_id": 2}"#);
    write(dir.path(), "tokenizer_config.json", r#"{"add_bos_token": true}"#);
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::Tokenizer(m) if m.contains("100000")), "{err}");
    // ... and is dropped when it is not added.
    write(dir.path(), "tokenizer_config.json", r#"{"add_bos_token": false}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.eos_ids()[0], 2);

    // GGUF token types: 2^32 + 3 would truncate to 3 (control).
    let mut md = gpt2_metadata("smollm", None);
    let Some(Value::Array(types)) = md.get_mut("tokenizer.ggml.token_type") else { panic!("no token types") };
    types[10] = Value::I64((1 << 32) + 3);
    assert!(matches!(Tokenizer::from_gguf_metadata(&md), Err(Error::Tokenizer(_))));
}

/// SentencePiece metadata with these pieces (after `<unk>`, `<s>`, `</s>`) and no merges.
fn spm_metadata_of(pieces: impl IntoIterator<Item = String>) -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    tokens.extend(pieces);
    let scores = (0..tokens.len()).map(|i| Value::F32(-(i as f32))).collect();
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), string("llama"));
    md.insert("tokenizer.ggml.tokens".into(), strings(&tokens));
    md.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
    md.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
    md
}

#[test]
fn derived_merges_are_bounded() {
    // "a", "aa", ...: every split of every token is two tokens, so n tokens give n^2/2 merges
    // (180k here) holding n^3/6 bytes.
    let md = spm_metadata_of((1..=600).map(|n| "a".repeat(n)));
    let err = Tokenizer::from_gguf_metadata(&md).unwrap_err();
    assert!(matches!(&err, Error::Tokenizer(m) if m.contains("gives more than")), "{err}");
    // One huge token: few merges, but every split hashes the whole token.
    let md = spm_metadata_of(["a".to_string(), "a".repeat(20_000)]);
    let err = Tokenizer::from_gguf_metadata(&md).unwrap_err();
    assert!(matches!(&err, Error::Tokenizer(m) if m.contains("would hash more than")), "{err}");
    // A plausible vocabulary of the same pieces, shorter, still loads.
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata_of((1..=100).map(|n| "a".repeat(n)))).unwrap();
    assert_eq!(tok.decode(&tok.encode("aaaaa", false).unwrap()).unwrap(), "aaaaa");
}

// -------------------------------------------------------------------------------------------
// The default model (SmolLM2-135M-Instruct GGUF) and the HF reference fixture
// -------------------------------------------------------------------------------------------

fn default_model() -> PathBuf {
    ferrum_runner::fetch::default_model_path(false).expect("the default model (SmolLM2-135M-Instruct GGUF)")
}

fn smollm2_tokenizer() -> Tokenizer {
    let path = default_model();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    Tokenizer::from_gguf_metadata(&content.metadata).unwrap()
}

#[test]
fn smollm2_gguf_tokenizer() {
    let tok = smollm2_tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert!(!tok.add_bos(), "SmolLM2's GGUF says add_bos_token = false");
    assert_eq!(tok.eos_ids()[0], 2);
    assert!(tok.is_eos(0), "<|endoftext|> ends generation too");
    assert_eq!(tok.chat_template(), Some(SMOLLM2_TEMPLATE));
    let prompt = tok.render_user_prompt("Hi there").unwrap();
    let ids = tok.encode(&prompt, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(tok.decode(&ids).unwrap(), prompt);
    for s in SAMPLES {
        let ids = tok.encode(s, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), *s);
        let (_, joined) = stream_all(&tok, &ids, false);
        assert_eq!(joined, *s);
    }
    // SmolLM2 splits digits one by one.
    assert_eq!(tok.encode("12345", false).unwrap().len(), 5);
    check_stream_property(&tok, 5, 500);

    // Optional: compare against a reference produced by Python `tokenizers`/transformers,
    // a JSON list of {"text": ..., "ids": [...]}, when FERRUM_TOKENIZER_REFERENCE names one.
    if let Some(path) = std::env::var_os("FERRUM_TOKENIZER_REFERENCE") {
        let cases: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        for case in &cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?}");
        }
        eprintln!("{} reference cases match", cases.len());
    }
}

fn fixture() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2/reference.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap()
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn messages_of(v: &serde_json::Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).unwrap()
}

/// HF transformers' token ids and chat renderings for the default model
/// (`tests/fixtures/smollm2/reference.json`).
#[test]
fn smollm2_matches_hf_fixture() {
    let tok = smollm2_tokenizer();
    let fx = fixture();
    let t = &fx["tokenizer"];
    assert_eq!(tok.add_bos(), t["add_bos"].as_bool().unwrap());
    assert_eq!(tok.bos_id(), Some(t["bos_token_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.eos_ids()[0], t["eos_token_id"].as_u64().unwrap() as u32);
    assert_eq!(tok.bos_token(), t["bos_token"].as_str());
    assert_eq!(tok.eos_token(), t["eos_token"].as_str());
    assert_eq!(tok.chat_template(), t["chat_template"].as_str());
    assert_eq!(tok.vocab_size() as u64, fx["model"]["vocab_size"].as_u64().unwrap());

    let cases = fx["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let want = ids_of(&case["prompt_ids"]);
        let got = tok.encode(prompt, true).unwrap();
        assert_eq!(got, want, "case {name}: encode({prompt:?})");
        let tokens: Vec<String> = got.iter().map(|&id| tok.token_str(id).unwrap()).collect();
        let want_tokens: Vec<String> = serde_json::from_value(case["prompt_tokens"].clone()).unwrap();
        assert_eq!(tokens, want_tokens, "case {name}");
        assert_eq!(tok.decode(&got).unwrap(), prompt, "case {name}: decode round trip");
        let (_, streamed) = stream_all(&tok, &got, false);
        assert_eq!(streamed, prompt, "case {name}: streamed decode");
        if case["kind"] == "chat" {
            let msgs = messages_of(&case["messages"]);
            let rendered = tok.apply_chat_template(&msgs, true).unwrap();
            assert_eq!(rendered, case["chat_rendered"].as_str().unwrap(), "case {name}");
            assert_eq!(rendered, prompt, "case {name}");
        }
        // Generated text: HF's decode(skip_special_tokens=False), whole and streamed.
        let greedy = ids_of(&case["greedy_ids"]);
        let text = case["greedy_text"].as_str().unwrap();
        assert_eq!(tok.decode(&greedy).unwrap(), text, "case {name}: greedy_text");
        let (_, streamed) = stream_all(&tok, &greedy, false);
        assert_eq!(streamed, text, "case {name}: streamed greedy_text");
    }

    let chats = fx["chat_template_cases"].as_array().unwrap();
    assert!(!chats.is_empty());
    for case in chats {
        let name = case["name"].as_str().unwrap();
        let msgs = messages_of(&case["messages"]);
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = tok.apply_chat_template(&msgs, gen).unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "chat case {name}");
        assert_eq!(tok.encode(&rendered, true).unwrap(), ids_of(&case["ids"]), "chat case {name}");
    }
}
