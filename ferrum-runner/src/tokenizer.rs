//! The tokenizer: HF `tokenizer.json` directories and GGUF-embedded vocabularies, encoding,
//! decoding and streaming (token-by-token) decoding.
//!
//! Both loaders produce a [`tokenizers::Tokenizer`] (the Rust core of HF `tokenizers`), so
//! encoding is bit-for-bit what HF transformers' fast tokenizers do:
//!
//! * [`Tokenizer::from_hf_dir`] reads `tokenizer.json`, plus `tokenizer_config.json`
//!   (`bos_token`, `eos_token`, `add_bos_token`, `add_eos_token`, `chat_template`),
//!   `generation_config.json` and `config.json` (`eos_token_id`, `bos_token_id`) when present.
//! * [`Tokenizer::from_gguf_metadata`] rebuilds the tokenizer from the `tokenizer.ggml.*` keys
//!   of a GGUF file:
//!   * `tokenizer.ggml.model == "gpt2"`: byte-level BPE (GPT-2, SmolLM/SmolLM2, Llama 3,
//!     Qwen2/2.5/3, StarCoder, ...) from `tokens` + `merges`, with the split regex chosen by
//!     `tokenizer.ggml.pre` (see [`PreTokenizerKind`]);
//!   * `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback (Llama 2,
//!     TinyLlama, Mistral v0.1-v0.3) from `tokens` + `scores`, with merges derived from the
//!     scores exactly as HF transformers' `GGUFTokenizerSkeleton` does, the `▁` normalizer and
//!     the `Replace`/`ByteFallback`/`Fuse`/`Strip` decoder of HF's `LlamaConverter`.
//!
//!   Tokens of type control (3) and unknown (2) become special added tokens and tokens of
//!   type user-defined (4) become (non-special) added tokens, so `<|im_start|>`, `<s>`,
//!   `<|eot_id|>` ... in text always encode to their single id.
//!
//! ## BOS / EOS
//!
//! [`Tokenizer::encode`] with `add_special = true` prepends BOS only when the model asks for
//! it ([`Tokenizer::add_bos`]) and appends EOS only when it asks for that
//! ([`Tokenizer::add_eos`]):
//!
//! * GGUF: `tokenizer.ggml.add_bos_token` / `add_eos_token` when present; otherwise the
//!   llama.cpp defaults: BOS for SentencePiece (`llama`) vocabularies and for the Llama 3
//!   pre-tokenizer family (`llama3`, `llama-bpe`, ...), no BOS for other byte-level BPE
//!   vocabularies (SmolLM2, Qwen2, GPT-2), never EOS.
//! * HF directory: `add_bos_token` / `add_eos_token` of `tokenizer_config.json` when present;
//!   otherwise whatever `tokenizer.json`'s post-processor adds (detected once at load time).
//!
//! Special-token text inside `text` is always parsed (as HF does), independent of
//! `add_special`: the output of a chat template tokenizes to the right control ids.
//!
//! ## Decoding
//!
//! [`Tokenizer::decode`] keeps special tokens (HF `skip_special_tokens=False`), so
//! `decode(encode(s, false)) == s` for every string the vocabulary can represent.
//! [`StreamDecoder`] decodes one id at a time and only ever emits whole UTF-8 characters;
//! the concatenation of its pieces and its final [`StreamDecoder::flush`] equals
//! [`Tokenizer::decode`] of all the ids.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};

/// The GPT-2 split regex (what `ByteLevel(use_regex=true)` applies).
pub const GPT2_SPLIT_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The Llama 3 split regex (from Llama 3's `tokenizer.json`).
pub const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Qwen2 split regex (from Qwen2's `tokenizer.json`): as Llama 3 but single digits.
pub const QWEN2_SPLIT_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Qwen3.5 split regex: as Qwen2, letters keep their combining marks.
pub const QWEN35_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken split regex.
pub const TEKKEN_SPLIT_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The o200k split regex (GPT-4o, Llama 4).
pub const GPT4O_SPLIT_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Token texts that end generation when present in a vocabulary as special tokens (llama.cpp's
/// end-of-generation heuristic, `llama-vocab.cpp`).
const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// How a byte-level BPE vocabulary splits text before BPE, chosen from GGUF
/// `tokenizer.ggml.pre` with the same grouping as llama.cpp's `llama-vocab.cpp` and the
/// regexes of the models' own `tokenizer.json` (as HF transformers' GGUF loader uses them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreTokenizerKind {
    /// `ByteLevel(use_regex = true)`: the GPT-2 regex. `default`, `gpt-2`, `gpt2`, `phi-2`,
    /// `mpt`, `olmo`, `jais`, `jina-*`, `roberta-bpe`, `exaone4`, ... and any missing or
    /// unrecognised value (with a warning), as llama.cpp and HF's `GGUFGPTConverter` do.
    Gpt2,
    /// Every digit split off on its own, then the GPT-2 regex (HF: `Digits(individual_digits)`
    /// followed by `ByteLevel`; llama.cpp: `\p{N}` then the GPT-2 regex). `smollm`
    /// (SmolLM/SmolLM2), `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`,
    /// `minerva-7b`.
    Gpt2SplitDigits,
    /// The Llama 3 regex (numbers in groups of up to three). `llama3`, `llama-v3`, `llama-bpe`,
    /// `falcon3`, `falcon-h1`, `pixtral`, `midm-2.0`, `lfm2` (these also bypass the merges for
    /// whole words found in the vocabulary, `ignore_merges`), and `dbrx`, `smaug-bpe`,
    /// `chatglm-bpe`, `glm4`.
    Llama3,
    /// The Qwen2 regex (single digits), with NFC normalisation. `qwen2`, `deepseek-r1-qwen`,
    /// `stablelm2`, `megrez`, `hunyuan`, `kormo`.
    Qwen2,
    /// The Qwen3.5 regex (letters with their combining marks), with NFC normalisation. `qwen35`.
    Qwen35,
    /// Mistral's Tekken regex, with `ignore_merges`. `tekken`.
    Tekken,
    /// The o200k (GPT-4o / Llama 4) regex. `gpt-4o`, `llama4`.
    Gpt4o,
}

impl PreTokenizerKind {
    /// Maps a `tokenizer.ggml.pre` value. Returns `None` for values not listed on the
    /// variants (the caller falls back to [`PreTokenizerKind::Gpt2`]).
    pub fn from_gguf_pre(pre: &str) -> Option<Self> {
        Some(match pre {
            "default" | "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "jina-es" | "jina-de" | "jina-v1-en"
            | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" | "roberta-bpe" | "gigachat" | "a.x-4.0" | "mellum"
            | "modern-bert" | "exaone4" | "trillion" | "granite-docling" => PreTokenizerKind::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
                PreTokenizerKind::Gpt2SplitDigits
            }
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
            | "dbrx" | "smaug-bpe" | "chatglm-bpe" | "glm4" => PreTokenizerKind::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" | "kormo" => PreTokenizerKind::Qwen2,
            "qwen35" => PreTokenizerKind::Qwen35,
            "tekken" => PreTokenizerKind::Tekken,
            "gpt-4o" | "llama4" => PreTokenizerKind::Gpt4o,
            _ => return None,
        })
    }

    /// Whether llama.cpp adds BOS by default for this `tokenizer.ggml.pre` value.
    fn default_add_bos(pre: &str) -> bool {
        matches!(
            pre,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "tekken"
        )
    }

    /// Whether whole pre-tokens found in the vocabulary bypass the merges (`ignore_merges`),
    /// as llama.cpp does for these values (and their `tokenizer.json` files say).
    fn ignore_merges(pre: &str) -> bool {
        Self::default_add_bos(pre)
    }

    /// Whether the model's own tokenizer NFC-normalises text first.
    fn nfc(self) -> bool {
        matches!(self, PreTokenizerKind::Qwen2 | PreTokenizerKind::Qwen35)
    }

    fn pre_tokenizer(self) -> Result<PreTokenizerWrapper> {
        let byte_level = |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
        let split_then_bytes = |re: &str| -> Result<PreTokenizerWrapper> {
            let split = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(format!("bad split regex: {e}")))?;
            Ok(PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(vec![
                PreTokenizerWrapper::Split(split),
                byte_level(false),
            ])))
        };
        Ok(match self {
            PreTokenizerKind::Gpt2 => byte_level(true),
            PreTokenizerKind::Gpt2SplitDigits => PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ])),
            PreTokenizerKind::Llama3 => split_then_bytes(LLAMA3_SPLIT_REGEX)?,
            PreTokenizerKind::Qwen2 => split_then_bytes(QWEN2_SPLIT_REGEX)?,
            PreTokenizerKind::Qwen35 => split_then_bytes(QWEN35_SPLIT_REGEX)?,
            PreTokenizerKind::Tekken => split_then_bytes(TEKKEN_SPLIT_REGEX)?,
            PreTokenizerKind::Gpt4o => split_then_bytes(GPT4O_SPLIT_REGEX)?,
        })
    }
}

/// GPT-2's byte-to-printable-character table (`bytes_to_unicode`): byte-level BPE vocabularies
/// spell byte `b` as the character `byte_level_alphabet()[b]`.
pub fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        // Codes are below 0x200, all valid scalar values.
        table[usize::from(b)] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// The inverse of [`byte_level_alphabet`], indexed by character code (all codes are < 0x144).
fn byte_level_inverse() -> Vec<Option<u8>> {
    let mut inv = vec![None; 0x144];
    for (b, c) in byte_level_alphabet().iter().enumerate() {
        inv[*c as usize] = Some(b as u8);
    }
    inv
}

/// How ids turn into text; decides the [`StreamDecoder`] strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeKind {
    /// `ByteLevel` decoder: text = UTF-8-lossy of the concatenated token bytes.
    ByteLevel,
    /// HF `LlamaConverter` decoder: `Replace(▁, " ")`, `ByteFallback`, `Fuse`, and, when
    /// `strip` is set, `Strip(" ", 1, 0)`.
    Spm { strip: bool },
    /// Any other decoder: streamed by re-decoding and diffing.
    Generic,
}

/// One token's contribution to decoded text, precomputed per id.
#[derive(Debug, Clone)]
enum Piece {
    /// No token with this id: contributes nothing (HF drops such ids).
    Nothing,
    /// Raw bytes (byte-level vocabularies).
    Bytes(Box<[u8]>),
    /// Text, `▁` already replaced by a space (SentencePiece vocabularies).
    Text(Box<str>),
    /// A `<0xXX>` byte-fallback token (SentencePiece vocabularies).
    Byte(u8),
}

/// A loaded tokenizer; see the [module documentation](self).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    kind: DecodeKind,
    pieces: Vec<Piece>,
    special: Vec<bool>,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    prefix_ids: Vec<u32>,
    suffix_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<String>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("decode_kind", &self.kind)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("prefix_ids", &self.prefix_ids)
            .field("suffix_ids", &self.suffix_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

fn tok_err(what: impl fmt::Display) -> Error {
    Error::Tokenizer(what.to_string())
}

// ---------------------------------------------------------------------------------------------
// GGUF metadata helpers
// ---------------------------------------------------------------------------------------------

fn md_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(i64::from(x)),
        Value::U16(x) => Some(i64::from(x)),
        Value::U32(x) => Some(i64::from(x)),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I8(x) => Some(i64::from(x)),
        Value::I16(x) => Some(i64::from(x)),
        Value::I32(x) => Some(i64::from(x)),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

fn md_f32(v: &Value) -> Option<f32> {
    match *v {
        Value::F32(x) => Some(x),
        Value::F64(x) => Some(x as f32),
        _ => md_i64(v).map(|x| x as f32),
    }
}

fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => Err(tok_err(format!("GGUF key `{key}` should be a string, found {:?}", other.value_type()))),
    }
}

fn md_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => md_i64(v)
            .map(|x| Some(x != 0))
            .ok_or_else(|| tok_err(format!("GGUF key `{key}` should be a bool, found {:?}", v.value_type()))),
    }
}

/// An optional token id; ids outside the vocabulary are ignored with a warning, as llama.cpp does.
fn md_token_id(md: &HashMap<String, Value>, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else { return Ok(None) };
    let id = crate::gguf::value_as_u64(v)
        .ok_or_else(|| tok_err(format!("GGUF key `{key}` should be a token id, found {v:?}")))?;
    if id >= n_tokens as u64 {
        tracing::warn!("GGUF `{key}` = {id} is outside the vocabulary of {n_tokens} tokens; ignored");
        return Ok(None);
    }
    Ok(Some(id as u32))
}

fn md_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a [Value]>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(other) => Err(tok_err(format!("GGUF key `{key}` should be an array, found {:?}", other.value_type()))),
    }
}

fn md_string_array(md: &HashMap<String, Value>, key: &str) -> Result<Option<Vec<String>>> {
    let Some(arr) = md_array(md, key)? else { return Ok(None) };
    arr.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(tok_err(format!("GGUF `{key}`[{i}] should be a string, found {:?}", other.value_type()))),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

// ---------------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------------

/// Special token ids and texts gathered by a loader before [`Tokenizer::finish`].
struct Specials {
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    prefix_ids: Vec<u32>,
    suffix_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from an HF model directory, with the special-token settings of
    /// `tokenizer_config.json`, `generation_config.json` and `config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tok_path).map_err(|e| Error::io(&tok_path, e))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tok_err(format!("{}: {e}", tok_path.display())))?;

        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| tok_err(format!("{}: {e}", path.display()))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(path, e)),
            }
        };
        let tok_config = read_json("tokenizer_config.json")?.unwrap_or(serde_json::Value::Null);
        let gen_config = read_json("generation_config.json")?.unwrap_or(serde_json::Value::Null);
        let model_config = read_json("config.json")?.unwrap_or(serde_json::Value::Null);

        // `bos_token` / `eos_token` are a string or an AddedToken dict {"content": ...}.
        let token_text = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
                _ => None,
            }
        };
        // `bos_token_id` / `eos_token_id`: an id or a list of ids. A non-negative integer that
        // does not fit a u32 is an error rather than truncated (4294967298 must not quietly
        // become 2); anything else that is not an id (a negative number, a string) is skipped
        // with a warning, as before.
        let ids_of = |v: &serde_json::Value, key: &str| -> Result<Vec<u32>> {
            let one = |x: &serde_json::Value| -> Result<Option<u32>> {
                match x.as_u64() {
                    Some(n) => u32::try_from(n)
                        .map(Some)
                        .map_err(|_| tok_err(format!("`{key}` holds {n}, which is not a token id (too large)"))),
                    None => {
                        tracing::warn!("ignoring `{key}` entry {x}: not a token id");
                        Ok(None)
                    }
                }
            };
            match v {
                serde_json::Value::Array(a) => a.iter().filter_map(|x| one(x).transpose()).collect(),
                serde_json::Value::Null => Ok(Vec::new()),
                x => Ok(one(x)?.into_iter().collect()),
            }
        };
        let first_id = |cfg: &serde_json::Value, key: &str| -> Result<Option<u32>> {
            Ok(match cfg.get(key) {
                Some(v) => ids_of(v, key)?.first().copied(),
                None => None,
            })
        };

        let bos_text = tok_config.get("bos_token").and_then(token_text);
        let eos_text = tok_config.get("eos_token").and_then(token_text);
        let bos_id = match bos_text.as_deref().and_then(|t| inner.token_to_id(t)) {
            Some(id) => Some(id),
            None => match first_id(&gen_config, "bos_token_id")? {
                Some(id) => Some(id),
                None => first_id(&model_config, "bos_token_id")?,
            },
        };

        let mut eos_ids = Vec::new();
        if let Some(id) = eos_text.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        for cfg in [&gen_config, &model_config] {
            if let Some(v) = cfg.get("eos_token_id") {
                eos_ids.extend(ids_of(v, "eos_token_id")?);
            }
        }

        // Chat template: tokenizer_config.json (a string, or a list of named templates),
        // else chat_template.jinja / chat_template.json next to it (newer transformers).
        let mut chat_template = match tok_config.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: &str| list.iter().find(|e| e.get("name").and_then(|n| n.as_str()) == Some(want));
                named("default")
                    .or_else(|| list.first())
                    .and_then(|e| e.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
            }
            _ => None,
        };
        if chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                chat_template = Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?);
            } else if let Some(v) = read_json("chat_template.json")? {
                chat_template = v.get("chat_template").and_then(|t| t.as_str()).map(str::to_string);
            }
        }

        // BOS/EOS insertion: explicit flags win, otherwise what the post-processor adds.
        let explicit_bos = tok_config.get("add_bos_token").and_then(|v| v.as_bool());
        let explicit_eos = tok_config.get("add_eos_token").and_then(|v| v.as_bool());
        let (mut prefix_ids, mut suffix_ids) = detect_post_processor_ids(&inner)?;
        if let Some(add) = explicit_bos {
            prefix_ids = if add { bos_id.into_iter().collect() } else { Vec::new() };
        }
        if let Some(add) = explicit_eos {
            let eos = eos_text.as_deref().and_then(|t| inner.token_to_id(t)).or(eos_ids.first().copied());
            suffix_ids = if add { eos.into_iter().collect() } else { Vec::new() };
        }

        let mut tok = Self::finish(inner, Specials { bos_id, eos_ids, prefix_ids, suffix_ids, chat_template })?;
        // Keep the configured texts even when the id lookup failed.
        if tok.bos_token.is_none() {
            tok.bos_token = bos_text;
        }
        if tok.eos_token.is_none() {
            tok.eos_token = eos_text;
        }
        Ok(tok)
    }

    /// Reads the metadata of a GGUF file and builds its tokenizer
    /// (see [`Tokenizer::from_gguf_metadata`]).
    ///
    /// The file goes through [`GgufFile::open`](crate::gguf::GgufFile::open), so its header is
    /// validated before candle parses it, and the same precondition applies: the file must not
    /// be modified or truncated while this call reads it.
    pub fn from_gguf_file(path: &Path) -> Result<Self> {
        let file = crate::gguf::GgufFile::open(path)?;
        Self::from_gguf_metadata(file.metadata())
    }

    /// Builds the tokenizer described by the `tokenizer.ggml.*` and `tokenizer.chat_template`
    /// keys of GGUF metadata (see the [module documentation](self)).
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let model = md_str(md, "tokenizer.ggml.model")?
            .ok_or_else(|| tok_err("GGUF has no `tokenizer.ggml.model` (no embedded tokenizer)"))?;
        let mut tokens = md_string_array(md, "tokenizer.ggml.tokens")?
            .ok_or_else(|| tok_err("GGUF has no `tokenizer.ggml.tokens`"))?;
        if tokens.is_empty() || tokens.len() > crate::config::limits::MAX_VOCAB {
            return Err(tok_err(format!("GGUF vocabulary has {} tokens", tokens.len())));
        }
        let n = tokens.len();
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let token_types: Vec<i32> = match md_array(md, "tokenizer.ggml.token_type")? {
            None => vec![token_type::NORMAL; n],
            Some(a) => {
                if a.len() != n {
                    return Err(tok_err(format!("GGUF has {} token types for {n} tokens", a.len())));
                }
                // A type that does not fit an i32 is an error, not truncated to a valid type.
                a.iter()
                    .map(|v| {
                        md_i64(v)
                            .and_then(|x| i32::try_from(x).ok())
                            .ok_or_else(|| tok_err(format!("bad GGUF token type {v:?}")))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let pre = md_str(md, "tokenizer.ggml.pre")?.unwrap_or("default");
        let chat_template = md_str(md, "tokenizer.chat_template")?.map(str::to_string);

        let (inner, default_bos, default_add_bos) = match model {
            "gpt2" => (build_gguf_bpe(md, &tokens, &token_types, pre)?, None, PreTokenizerKind::default_add_bos(pre)),
            "llama" => (build_gguf_spm(md, &tokens, &token_types)?, (n > 1).then_some(1u32), true),
            other => {
                return Err(tok_err(format!("unsupported GGUF tokenizer model `{other}` (supported: gpt2, llama)")))
            }
        };

        let bos_id = md_token_id(md, "tokenizer.ggml.bos_token_id", n)?.or(default_bos);
        let mut eos_ids: Vec<u32> = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eos_ids.extend(md_token_id(md, key, n)?);
        }
        if eos_ids.is_empty() && model == "llama" && n > 2 {
            eos_ids.push(2);
        }
        let add_bos = md_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        let add_eos = md_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let prefix_ids = if add_bos { bos_id.into_iter().collect() } else { Vec::new() };
        let suffix_ids = if add_eos { eos_ids.first().copied().into_iter().collect() } else { Vec::new() };

        Self::finish(inner, Specials { bos_id, eos_ids, prefix_ids, suffix_ids, chat_template })
    }

    /// Common tail of the loaders: the per-id decode tables and the end-of-generation set.
    fn finish(inner: tokenizers::Tokenizer, s: Specials) -> Result<Self> {
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if vocab_size == 0 {
            return Err(tok_err("empty vocabulary"));
        }
        // The per-id tables below hold `vocab_size` entries, and `vocab_size` comes from the
        // largest id in the file, not from how many tokens it has: one token with id 2^32 - 2
        // would ask for a 96 GiB table.
        let max_vocab = crate::config::limits::MAX_VOCAB;
        if vocab_size > max_vocab {
            return Err(tok_err(format!(
                "the vocabulary has a token id of {}, past the limit of {max_vocab} ids",
                vocab_size - 1
            )));
        }
        let n_ids = u32::try_from(vocab_size).map_err(|_| tok_err(format!("{vocab_size} ids do not fit a u32")))?;
        // Ids that `encode` adds around every text must name real tokens; the BOS/EOS ids
        // themselves are only dropped with a warning (as for GGUF, where llama.cpp does so).
        if let Some(&id) = s.prefix_ids.iter().chain(&s.suffix_ids).find(|&&id| id >= n_ids) {
            return Err(tok_err(format!(
                "the BOS/EOS id {id} added to every text is outside the vocabulary of {vocab_size} ids"
            )));
        }
        let kind = decode_kind(inner.get_decoder());
        let added = inner.get_added_tokens_decoder();
        let mut special = vec![false; vocab_size];
        for (&id, tok) in &added {
            if tok.special && (id as usize) < vocab_size {
                special[id as usize] = true;
            }
        }

        let inverse = byte_level_inverse();
        let pieces = (0..n_ids)
            .map(|id| match (inner.id_to_token(id), kind) {
                (None, _) | (_, DecodeKind::Generic) => Piece::Nothing,
                (Some(t), DecodeKind::ByteLevel) => {
                    let mapped: Option<Vec<u8>> =
                        t.chars().map(|c| inverse.get(c as usize).copied().flatten()).collect();
                    Piece::Bytes(mapped.unwrap_or_else(|| t.into_bytes()).into_boxed_slice())
                }
                (Some(t), DecodeKind::Spm { .. }) => match byte_fallback_value(&t) {
                    Some(b) => Piece::Byte(b),
                    None => Piece::Text(t.replace('\u{2581}', " ").into_boxed_str()),
                },
            })
            .collect();

        // End of generation: the configured EOS ids plus llama.cpp's EOG texts (special only).
        let mut eos_ids = Vec::new();
        let mut seen = HashSet::new();
        for id in s.eos_ids {
            if id >= n_ids {
                tracing::warn!("EOS id {id} is outside the vocabulary of {vocab_size} ids; ignored");
            } else if seen.insert(id) {
                eos_ids.push(id);
            }
        }
        let mut heuristic: Vec<u32> = EOG_TOKEN_TEXTS
            .iter()
            .filter_map(|t| vocab.get(*t).copied())
            .filter(|&id| special.get(id as usize).copied().unwrap_or(false))
            .collect();
        heuristic.sort_unstable();
        for id in heuristic {
            if seen.insert(id) {
                eos_ids.push(id);
            }
        }

        let bos_id = s.bos_id.filter(|&id| {
            let known = id < n_ids;
            if !known {
                tracing::warn!("BOS id {id} is outside the vocabulary of {vocab_size} ids; ignored");
            }
            known
        });
        let bos_token = bos_id.and_then(|id| inner.id_to_token(id));
        let eos_token = eos_ids.first().and_then(|&id| inner.id_to_token(id));
        Ok(Tokenizer {
            inner,
            kind,
            pieces,
            special,
            vocab_size,
            bos_id,
            eos_ids,
            prefix_ids: s.prefix_ids,
            suffix_ids: s.suffix_ids,
            bos_token,
            eos_token,
            chat_template: s.chat_template,
        })
    }
}

/// `<0xXX>` byte-fallback token value.
fn byte_fallback_value(token: &str) -> Option<u8> {
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        u8::from_str_radix(&token[3..5], 16).ok()
    } else {
        None
    }
}

/// Classifies a `tokenizer.json` decoder by its serialized form.
fn decode_kind(decoder: Option<&DecoderWrapper>) -> DecodeKind {
    let Some(decoder) = decoder else { return DecodeKind::Generic };
    let Ok(json) = serde_json::to_value(decoder) else { return DecodeKind::Generic };
    let ty = |v: &serde_json::Value| v.get("type").and_then(|t| t.as_str()).map(str::to_string);
    match ty(&json).as_deref() {
        Some("ByteLevel") => DecodeKind::ByteLevel,
        Some("Sequence") => {
            let Some(list) = json.get("decoders").and_then(|d| d.as_array()) else { return DecodeKind::Generic };
            let is_replace = |v: &serde_json::Value| {
                ty(v).as_deref() == Some("Replace")
                    && v.get("pattern").and_then(|p| p.get("String")).and_then(|s| s.as_str()) == Some("\u{2581}")
                    && v.get("content").and_then(|c| c.as_str()) == Some(" ")
            };
            let is = |v: &serde_json::Value, name: &str| ty(v).as_deref() == Some(name);
            let is_strip = |v: &serde_json::Value| {
                is(v, "Strip")
                    && v.get("content").and_then(|c| c.as_str()) == Some(" ")
                    && v.get("start").and_then(|c| c.as_u64()) == Some(1)
                    && v.get("stop").and_then(|c| c.as_u64()) == Some(0)
            };
            match list.as_slice() {
                [r, b, f] if is_replace(r) && is(b, "ByteFallback") && is(f, "Fuse") => {
                    DecodeKind::Spm { strip: false }
                }
                [r, b, f, s] if is_replace(r) && is(b, "ByteFallback") && is(f, "Fuse") && is_strip(s) => {
                    DecodeKind::Spm { strip: true }
                }
                [only] if is(only, "ByteLevel") => DecodeKind::ByteLevel,
                _ => DecodeKind::Generic,
            }
        }
        _ => DecodeKind::Generic,
    }
}

/// The ids `tokenizer.json`'s post-processor puts before and after a single sequence.
fn detect_post_processor_ids(inner: &tokenizers::Tokenizer) -> Result<(Vec<u32>, Vec<u32>)> {
    if inner.get_post_processor().is_none() {
        return Ok((Vec::new(), Vec::new()));
    }
    let probe = "a";
    let plain = inner.encode_fast(probe, false).map_err(tok_err)?.get_ids().to_vec();
    let full = inner.encode_fast(probe, true).map_err(tok_err)?.get_ids().to_vec();
    if plain.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    match full.windows(plain.len()).position(|w| w == plain.as_slice()) {
        Some(at) => Ok((full[..at].to_vec(), full[at + plain.len()..].to_vec())),
        None => {
            tracing::warn!("could not work out which special tokens the post-processor adds; adding none");
            Ok((Vec::new(), Vec::new()))
        }
    }
}

/// A byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`).
fn build_gguf_bpe(
    md: &HashMap<String, Value>,
    tokens: &[String],
    token_types: &[i32],
    pre: &str,
) -> Result<tokenizers::Tokenizer> {
    let merges_raw = md_string_array(md, "tokenizer.ggml.merges")?
        .ok_or_else(|| tok_err("GGUF gpt2 tokenizer has no `tokenizer.ggml.merges`"))?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut merges = Vec::with_capacity(merges_raw.len());
    let mut dropped = 0usize;
    for m in merges_raw {
        // llama.cpp splits at the first space after the first byte.
        let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
        let Some(at) = split else {
            dropped += 1;
            continue;
        };
        let (a, b) = (&m[..at], &m[at + 1..]);
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}")) {
            merges.push((a.to_string(), b.to_string()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!("{dropped} GGUF merges are malformed or name tokens outside the vocabulary; ignored");
    }

    let kind = PreTokenizerKind::from_gguf_pre(pre).unwrap_or_else(|| {
        tracing::warn!("unrecognised tokenizer.ggml.pre `{pre}`; using the GPT-2 split regex");
        PreTokenizerKind::Gpt2
    });
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(PreTokenizerKind::ignore_merges(pre))
        .build()
        .map_err(|e| tok_err(format!("building BPE model: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    if kind.nfc() {
        tok.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
    }
    tok.with_pre_tokenizer(Some(kind.pre_tokenizer()?));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(false, true, true))));
    add_gguf_added_tokens(&mut tok, tokens, token_types);
    Ok(tok)
}

/// A SentencePiece-style BPE tokenizer with byte fallback (`tokenizer.ggml.model == "llama"`),
/// as HF transformers' `GGUFLlamaConverter` builds it.
fn build_gguf_spm(
    md: &HashMap<String, Value>,
    tokens: &[String],
    token_types: &[i32],
) -> Result<tokenizers::Tokenizer> {
    let n = tokens.len();
    let scores: Vec<f32> = match md_array(md, "tokenizer.ggml.scores")? {
        Some(a) if a.len() == n => a
            .iter()
            .map(|v| md_f32(v).ok_or_else(|| tok_err(format!("bad GGUF token score {v:?}"))))
            .collect::<Result<_>>()?,
        Some(a) => return Err(tok_err(format!("GGUF has {} scores for {n} tokens", a.len()))),
        None => return Err(tok_err("GGUF llama tokenizer has no `tokenizer.ggml.scores`")),
    };
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges = match md_string_array(md, "tokenizer.ggml.merges")? {
        Some(raw) => raw
            .iter()
            .filter_map(|m| m.split_once(' '))
            .filter(|(a, b)| vocab.contains_key(*a) && vocab.contains_key(*b) && vocab.contains_key(&format!("{a}{b}")))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
        None => spm_merges_from_scores(tokens, &scores)?,
    };

    let unk_id = md_token_id(md, "tokenizer.ggml.unknown_token_id", n)?.or_else(|| (tokens[0] == "<unk>").then_some(0));
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(true).byte_fallback(true);
    if let Some(unk) = unk_id {
        builder = builder.unk_token(tokens[unk as usize].clone());
    }
    let bpe = builder.build().map_err(|e| tok_err(format!("building BPE model: {e}")))?;

    let add_space_prefix = md_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let replace_space = Replace::new(" ", "\u{2581}").map_err(|e| tok_err(format!("building normalizer: {e}")))?;
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new("\u{2581}".to_string())));
    }
    normalizers.push(NormalizerWrapper::Replace(replace_space));

    let replace_meta = Replace::new("\u{2581}", " ").map_err(|e| tok_err(format!("building decoder: {e}")))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(replace_meta),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(NormalizerWrapper::Sequence(NormalizerSequence::new(normalizers))));
    tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(decoders))));
    add_gguf_added_tokens(&mut tok, tokens, token_types);
    Ok(tok)
}

/// Control and unknown tokens become special added tokens, user-defined ones plain added
/// tokens; none are normalised, so their text always maps to the single id.
fn add_gguf_added_tokens(tok: &mut tokenizers::Tokenizer, tokens: &[String], token_types: &[i32]) {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (t, &ty) in tokens.iter().zip(token_types) {
        match ty {
            token_type::CONTROL | token_type::UNKNOWN => {
                special.push(AddedToken::from(t.clone(), true).normalized(false))
            }
            token_type::USER_DEFINED => user.push(AddedToken::from(t.clone(), false).normalized(false)),
            _ => {}
        }
    }
    if !special.is_empty() {
        tok.add_special_tokens(&special);
    }
    if !user.is_empty() {
        tok.add_tokens(&user);
    }
}

/// How much hashing [`spm_merges_from_scores`] may do, in bytes: every split of a token of
/// `c` characters and `b` bytes looks both halves up, `(c - 1) * b` bytes in all. A merge
/// keeps the `b` bytes of the split it came from, so this also bounds the bytes of the
/// merges. A vocabulary of `MAX_VOCAB` (2^22) tokens of 8 ASCII characters needs
/// 2^22 * 7 * 8, about 235M; real ones need far less.
const MAX_MERGE_SCAN_BYTES: u64 = 1 << 28;

/// The most merges [`spm_merges_from_scores`] may derive, per vocabulary token and in all.
/// Real vocabularies give a few per token; tokens that split many ways ("a", "aa", "aaa",
/// ...) give one per split, so their merges grow with the square of the longest token.
const MAX_MERGES_PER_TOKEN: usize = 16;
const MAX_MERGES: usize = 1 << 23;
/// Small vocabularies may derive this many merges whatever their size.
const MIN_MERGE_BUDGET: usize = 1 << 16;

/// BPE merges for a SentencePiece vocabulary from its scores, exactly as HF transformers'
/// `GGUFTokenizerSkeleton` derives them: every split of every token into two vocabulary
/// pieces, ordered by the merged token's score (descending), ties by the pieces' scores.
///
/// The work and the merges grow faster than the vocabulary (with the cube of a token's length
/// in the worst case), so both are bounded; a vocabulary past either bound is an
/// [`Error::Tokenizer`].
pub fn spm_merges_from_scores(tokens: &[String], scores: &[f32]) -> Result<Vec<(String, String)>> {
    let max_merges = tokens.len().saturating_mul(MAX_MERGES_PER_TOKEN).clamp(MIN_MERGE_BUDGET, MAX_MERGES);
    let over = |what: String| {
        tok_err(format!(
            "deriving BPE merges from the scores of {} tokens {what}; the vocabulary is not a plausible \
             SentencePiece vocabulary",
            tokens.len()
        ))
    };
    // Python's dict keeps the first position of a key and the last value.
    let mut score_of: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (t, &s) in tokens.iter().zip(scores) {
        if score_of.insert(t.as_str(), s).is_none() {
            order.push(t.as_str());
        }
    }
    let desc = |a: f32, b: f32| b.total_cmp(&a);
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    let mut scanned: u64 = 0;
    for merged in order {
        // Counted before the lookups, so a single huge token cannot do the work first.
        let splits = merged.chars().count().saturating_sub(1) as u64;
        scanned = scanned.saturating_add(splits.saturating_mul(merged.len() as u64));
        if scanned > MAX_MERGE_SCAN_BYTES {
            return Err(over(format!("would hash more than {MAX_MERGE_SCAN_BYTES} bytes")));
        }
        let piece_score = score_of[merged];
        let mut local: Vec<(&str, &str, f32)> = merged
            .char_indices()
            .skip(1)
            .map(|(i, _)| (&merged[..i], &merged[i..]))
            .filter(|(l, r)| score_of.contains_key(l) && score_of.contains_key(r))
            .map(|(l, r)| (l, r, piece_score))
            .collect();
        local.sort_by(|a, b| desc(score_of[a.0], score_of[b.0]).then_with(|| desc(score_of[a.1], score_of[b.1])));
        if merges.len() + local.len() > max_merges {
            return Err(over(format!("gives more than {max_merges} merges")));
        }
        merges.extend(local);
    }
    merges.sort_by(|a, b| desc(a.2, b.2));
    Ok(merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect())
}

// ---------------------------------------------------------------------------------------------
// Encoding / decoding
// ---------------------------------------------------------------------------------------------

impl Tokenizer {
    /// Encodes `text`. With `add_special`, BOS/EOS are added only as the model's metadata asks
    /// ([`Tokenizer::add_bos`], [`Tokenizer::add_eos`]). Special-token text inside `text` is
    /// always recognised.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        if !add_special || (self.prefix_ids.is_empty() && self.suffix_ids.is_empty()) {
            return Ok(enc.get_ids().to_vec());
        }
        let mut ids = Vec::with_capacity(enc.len() + self.prefix_ids.len() + self.suffix_ids.len());
        ids.extend_from_slice(&self.prefix_ids);
        ids.extend_from_slice(enc.get_ids());
        ids.extend_from_slice(&self.suffix_ids);
        Ok(ids)
    }

    /// Decodes `ids` to text, special tokens included (HF `skip_special_tokens=False`).
    /// Invalid UTF-8 (e.g. an unfinished multi-byte character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Decodes `ids` to text leaving out special tokens (HF `skip_special_tokens=True`).
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, true)
    }

    fn decode_with(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.check_ids(ids)?;
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&token) => Err(Error::TokenOutOfRange { token, vocab: self.vocab_size }),
            None => Ok(()),
        }
    }

    /// A decoder that turns ids into text one at a time; special tokens are kept.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self, false)
    }

    /// A streaming decoder that leaves special tokens out.
    pub fn stream_decoder_skip_special(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self, true)
    }

    /// Renders `messages` with the model's chat template, its BOS and EOS texts
    /// (see [`crate::chat::render_chat`]). Fails with [`Error::ChatTemplate`] when the model
    /// has no chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[crate::chat::ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            Error::ChatTemplate(
                "the model has no chat template (no `tokenizer.chat_template` in the GGUF, no `chat_template` \
                 in tokenizer_config.json); use raw prompts instead"
                    .to_string(),
            )
        })?;
        crate::chat::render_chat(
            template,
            messages,
            add_generation_prompt,
            self.bos_token.as_deref().unwrap_or(""),
            self.eos_token.as_deref().unwrap_or(""),
        )
    }

    /// Renders `text` as a single user message with the model's chat template, ready for the
    /// assistant's reply (`add_generation_prompt`); encode the result with
    /// `encode(&rendered, false)` since the template already holds any BOS text.
    pub fn render_user_prompt(&self, text: &str) -> Result<String> {
        self.apply_chat_template(&[crate::chat::ChatMessage::user(text)], true)
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Every id that ends generation: the model's EOS id(s) first (the primary EOS is
    /// `eos_ids()[0]`), then EOT/EOM and special tokens such as `<|im_end|>`, `<|eot_id|>`,
    /// `<|endoftext|>` (llama.cpp's end-of-generation set).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.bos_id.is_some_and(|b| self.prefix_ids.contains(&b))
    }

    /// Whether [`Tokenizer::encode`] with `add_special` appends EOS.
    pub fn add_eos(&self) -> bool {
        !self.suffix_ids.is_empty()
    }

    /// The BOS token text (for chat templates), if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The primary EOS token text (for chat templates), if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Number of ids: one more than the largest id of the vocabulary or added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The model's Jinja chat template, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The vocabulary entry of `id` (byte-level tokens in their `Ġ`-style spelling),
    /// `None` out of range.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry or added token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The underlying HF `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming decode
// ---------------------------------------------------------------------------------------------

/// Incremental detokenizer: feed ids with [`StreamDecoder::step`], finish with
/// [`StreamDecoder::flush`].
///
/// Only whole characters are emitted: bytes of a multi-byte character that byte-level BPE
/// (or SentencePiece byte fallback) spreads over several tokens are held back until the
/// character is complete. The concatenation of everything `step` returns and what `flush`
/// returns equals [`Tokenizer::decode`] (or `decode_skip_special`) of all the ids.
///
/// Decoding starts at a text start: for SentencePiece vocabularies the first token's leading
/// space is dropped, as `decode` does.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    state: StreamState,
}

#[derive(Debug)]
enum StreamState {
    /// Bytes of an unfinished UTF-8 sequence.
    ByteLevel { pending: Vec<u8> },
    /// A run of byte-fallback tokens, and whether no text has been produced yet.
    Spm { group: Vec<u8>, at_start: bool, strip: bool },
    /// All ids so far and the text already emitted.
    Generic { ids: Vec<u32>, emitted: String },
}

impl fmt::Debug for StreamDecoder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("skip_special", &self.skip_special)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<'a> StreamDecoder<'a> {
    /// A decoder for `tok`; `skip_special` leaves special tokens out of the text.
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        let state = match tok.kind {
            DecodeKind::ByteLevel => StreamState::ByteLevel { pending: Vec::new() },
            DecodeKind::Spm { strip } => StreamState::Spm { group: Vec::new(), at_start: true, strip },
            DecodeKind::Generic => StreamState::Generic { ids: Vec::new(), emitted: String::new() },
        };
        StreamDecoder { tok, skip_special, state }
    }

    /// Feeds one id; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.tok.check_ids(&[id])?;
        if self.skip_special && self.tok.is_special(id) {
            return Ok(None);
        }
        let mut out = String::new();
        match &mut self.state {
            // `check_ids` bounds `id` by `vocab_size`, which is the table's length; `get` keeps
            // an id past it contributing nothing rather than panicking should the two disagree.
            StreamState::ByteLevel { pending } => {
                if let Some(Piece::Bytes(b)) = self.tok.pieces.get(id as usize) {
                    pending.extend_from_slice(b);
                    drain_utf8(pending, &mut out);
                }
            }
            StreamState::Spm { group, at_start, strip } => match self.tok.pieces.get(id as usize) {
                Some(Piece::Byte(b)) => group.push(*b),
                Some(Piece::Text(t)) => {
                    let mut text = resolve_byte_group(group);
                    text.push_str(t);
                    push_spm_text(&mut out, &text, at_start, *strip);
                }
                Some(Piece::Nothing | Piece::Bytes(_)) | None => {}
            },
            StreamState::Generic { ids, emitted } => {
                ids.push(id);
                let full = self.tok.decode_with(ids, self.skip_special)?;
                if full.len() > emitted.len() && full.starts_with(emitted.as_str()) && !full.ends_with('\u{FFFD}') {
                    out.push_str(&full[emitted.len()..]);
                    emitted.push_str(&out);
                }
            }
        }
        Ok((!out.is_empty()).then_some(out))
    }

    /// Ends the stream: returns the held-back text, if any (an unfinished character becomes
    /// U+FFFD, as in [`Tokenizer::decode`]), and resets the decoder for a new text.
    pub fn flush(&mut self) -> Result<Option<String>> {
        let mut out = String::new();
        match &mut self.state {
            StreamState::ByteLevel { pending } => {
                drain_utf8(pending, &mut out);
                if !pending.is_empty() {
                    out.push('\u{FFFD}');
                    pending.clear();
                }
            }
            StreamState::Spm { group, at_start, strip } => {
                let text = resolve_byte_group(group);
                push_spm_text(&mut out, &text, at_start, *strip);
                *at_start = true;
            }
            StreamState::Generic { ids, emitted } => {
                let full = self.tok.decode_with(ids, self.skip_special);
                let emitted = std::mem::take(emitted);
                ids.clear();
                let full = full?;
                if let Some(rest) = full.strip_prefix(emitted.as_str()) {
                    out.push_str(rest);
                } else {
                    tracing::warn!("decoder output is not prefix-stable; streamed text may differ from decode()");
                    let common = full
                        .char_indices()
                        .zip(emitted.chars())
                        .find(|((_, a), b)| a != b)
                        .map(|((i, _), _)| i)
                        .unwrap_or(emitted.len().min(full.len()));
                    out.push_str(&full[common..]);
                }
            }
        }
        Ok((!out.is_empty()).then_some(out))
    }
}

/// Moves every complete character (and U+FFFD for each invalid sequence) from `pending` to
/// `out`, keeping a trailing incomplete sequence; the same replacement rule as
/// `String::from_utf8_lossy`, applied incrementally.
fn drain_utf8(pending: &mut Vec<u8>, out: &mut String) {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // `valid` bytes from `start` are valid UTF-8 by the error's contract.
                out.push_str(std::str::from_utf8(&pending[start..start + valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        start += valid + bad;
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
}

/// HF `ByteFallback` on a finished run of byte tokens: the text if it is valid UTF-8, else one
/// U+FFFD per byte.
fn resolve_byte_group(group: &mut Vec<u8>) -> String {
    if group.is_empty() {
        return String::new();
    }
    let bytes = std::mem::take(group);
    match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => "\u{FFFD}".repeat(e.as_bytes().len()),
    }
}

/// Appends SentencePiece text, dropping the leading space of the whole text (HF `Strip`).
fn push_spm_text(out: &mut String, text: &str, at_start: &mut bool, strip: bool) {
    if text.is_empty() {
        return;
    }
    if *at_start {
        *at_start = false;
        if strip {
            out.push_str(text.strip_prefix(' ').unwrap_or(text));
            return;
        }
    }
    out.push_str(text);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let a = byte_level_alphabet();
        let set: HashSet<char> = a.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(a[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(a[b'\n' as usize], '\u{10A}'); // Ċ
        assert_eq!(a[b'A' as usize], 'A');
        let inv = byte_level_inverse();
        for (b, c) in a.iter().enumerate() {
            assert_eq!(inv[*c as usize], Some(b as u8));
        }
    }

    #[test]
    fn drain_utf8_matches_lossy() {
        let cases: &[&[u8]] = &[b"abc", "東京".as_bytes(), b"\xE6\x9D", b"\x80abc", b"a\xF0\x9F\x8E", b"\xC3\x28"];
        for case in cases {
            for split in 0..=case.len() {
                let mut pending = Vec::new();
                let mut out = String::new();
                pending.extend_from_slice(&case[..split]);
                drain_utf8(&mut pending, &mut out);
                pending.extend_from_slice(&case[split..]);
                drain_utf8(&mut pending, &mut out);
                if !pending.is_empty() {
                    out.push('\u{FFFD}');
                }
                assert_eq!(out, String::from_utf8_lossy(case), "{case:?} split at {split}");
            }
        }
    }

    #[test]
    fn pre_values() {
        assert_eq!(PreTokenizerKind::from_gguf_pre("smollm"), Some(PreTokenizerKind::Gpt2SplitDigits));
        assert_eq!(PreTokenizerKind::from_gguf_pre("llama-bpe"), Some(PreTokenizerKind::Llama3));
        assert_eq!(PreTokenizerKind::from_gguf_pre("qwen2"), Some(PreTokenizerKind::Qwen2));
        assert_eq!(PreTokenizerKind::from_gguf_pre("default"), Some(PreTokenizerKind::Gpt2));
        assert_eq!(PreTokenizerKind::from_gguf_pre("nonsense"), None);
        for kind in [
            PreTokenizerKind::Gpt2,
            PreTokenizerKind::Gpt2SplitDigits,
            PreTokenizerKind::Llama3,
            PreTokenizerKind::Qwen2,
            PreTokenizerKind::Qwen35,
            PreTokenizerKind::Tekken,
            PreTokenizerKind::Gpt4o,
        ] {
            kind.pre_tokenizer().unwrap();
        }
    }

    #[test]
    fn spm_merges_follow_scores() {
        let tokens: Vec<String> = ["<unk>", "a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.to_string()).collect();
        let scores = [0.0, -1.0, -2.0, -3.0, -0.5, -0.1, -0.2];
        let merges = spm_merges_from_scores(&tokens, &scores).unwrap();
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // bc (-0.1) first, then abc's splits (-0.2): (ab,c) before (a,bc) since ab scores higher than a, then ab.
        assert_eq!(pairs, vec![("b", "c"), ("ab", "c"), ("a", "bc"), ("a", "b")]);
    }
}
