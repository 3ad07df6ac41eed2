//! GGUF files (llama.cpp's format), read through candle-core's `gguf_file`.
//!
//! Before candle sees a file, [`scan`] walks its header with every count, string length,
//! array length and tensor extent checked against the bytes that are really there, so a
//! truncated or corrupt file is a typed error naming the file, never a panic or an
//! allocation sized by an unchecked header field.
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` (and their biases) of
//! `llama`-arch models for its interleaved RoPE. ferrum uses HF's half-split RoPE, so the
//! loader undoes that permutation ([`llama_unpermute_index`]), as HF transformers' GGUF loader
//! does (`reverse_permute_weights`). Quantized weights are reordered a whole row at a time:
//! quantization blocks run along the input dimension, so a row's bytes move as a unit.
//! Qwen2/Qwen3 files use NEOX RoPE in llama.cpp and are not permuted.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;

use crate::config::{Arch, Llama3RopeScaling, ModelConfig};
use crate::error::{Error, Result};
use crate::load::{self, check_shape, Progress, WeightSource};
use crate::weights::{LayerWeight, Linear, ModelWeights, WeightFormat, WeightName};

/// The GGUF (llama.cpp) name of a weight.
pub fn gguf_tensor_name(name: WeightName) -> String {
    use LayerWeight::*;
    match name {
        WeightName::Embed => "token_embd.weight".into(),
        WeightName::FinalNorm => "output_norm.weight".into(),
        WeightName::LmHead => "output.weight".into(),
        WeightName::Layer(i, w) => {
            let suffix = match w {
                AttnNorm => "attn_norm.weight",
                Q => "attn_q.weight",
                K => "attn_k.weight",
                V => "attn_v.weight",
                O => "attn_output.weight",
                QBias => "attn_q.bias",
                KBias => "attn_k.bias",
                VBias => "attn_v.bias",
                OBias => "attn_output.bias",
                QNorm => "attn_q_norm.weight",
                KNorm => "attn_k_norm.weight",
                MlpNorm => "ffn_norm.weight",
                Gate => "ffn_gate.weight",
                Up => "ffn_up.weight",
                Down => "ffn_down.weight",
            };
            format!("blk.{i}.{suffix}")
        }
    }
}

/// The name of llama.cpp's Llama 3.1 RoPE frequency-factor tensor.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// Whether llama.cpp stores this architecture's q/k rows permuted for interleaved RoPE.
pub fn arch_is_permuted(arch: Arch) -> bool {
    matches!(arch, Arch::Llama | Arch::Mistral)
}

// ---------------------------------------------------------------------------------------------
// Header scan
// ---------------------------------------------------------------------------------------------

/// What the validating scan learned about a file.
#[derive(Debug, Clone)]
pub struct ScanInfo {
    pub version: u32,
    pub tensor_count: u64,
    pub kv_count: u64,
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub tensor_data_offset: u64,
}

/// Deepest nesting of arrays accepted in metadata.
const MAX_ARRAY_DEPTH: usize = 8;

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn corrupt(&self, detail: String) -> Error {
        Error::Corrupt { path: self.path.to_path_buf(), detail }
    }

    fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: u64, what: &dyn fmt::Display) -> Result<&'a [u8]> {
        let rem = self.remaining();
        match usize::try_from(n) {
            Ok(n) if n <= rem => {
                let s = &self.b[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(self.corrupt(format!("{what} at byte {} needs {n} bytes, only {rem} remain", self.pos))),
        }
    }

    fn skip(&mut self, n: u64, what: &dyn fmt::Display) -> Result<()> {
        self.bytes(n, what).map(|_| ())
    }

    fn array<const N: usize>(&mut self, what: &dyn fmt::Display) -> Result<[u8; N]> {
        let s = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn fmt::Display) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn fmt::Display) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn fmt::Display) -> Result<&'a [u8]> {
        let len = self.u64(what)?;
        self.bytes(len, what)
    }

    /// Skips one metadata value of type `ty`, checking every length first.
    fn skip_value(&mut self, ty: u32, key: &str, depth: usize) -> Result<()> {
        let what = format_args!("value of `{key}`");
        match ty {
            0 | 1 => self.skip(1, &what)?,
            7 => {
                let b = self.bytes(1, &what)?[0];
                if b > 1 {
                    return Err(self.corrupt(format!("bool `{key}` holds {b}")));
                }
            }
            2 | 3 => self.skip(2, &what)?,
            4..=6 => self.skip(4, &what)?,
            10..=12 => self.skip(8, &what)?,
            8 => {
                self.string(&what)?;
            }
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt(format!("`{key}` nests arrays deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem = self.u32(&what)?;
                let len = self.u64(&what)?;
                let min_size: u64 = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => 8,
                    9 => 12,
                    t => return Err(self.corrupt(format!("array `{key}` has unknown element type {t}"))),
                };
                let need = len.checked_mul(min_size).filter(|&n| n <= self.remaining() as u64).ok_or_else(|| {
                    self.corrupt(format!(
                        "array `{key}` declares {len} elements at byte {}, more than the {} bytes left can hold",
                        self.pos,
                        self.remaining()
                    ))
                })?;
                match elem {
                    7..=9 => {
                        for _ in 0..len {
                            self.skip_value(elem, key, depth + 1)?;
                        }
                    }
                    _ => self.skip(need, &what)?,
                }
            }
            t => return Err(self.corrupt(format!("`{key}` has unknown value type {t}"))),
        }
        Ok(())
    }
}

/// The ggml tensor types candle can read from a file (ids from ggml.h). Q8_1 (9) and Q8_K
/// (15) are left out: candle knows them as types but its GGUF tensor reader does not load
/// them, so they get the unsupported-dtype error here rather than a failure mid-load.
fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Names as candle stores them: trailing NULs dropped, invalid UTF-8 replaced.
fn gguf_str(b: &[u8]) -> String {
    let mut end = b.len();
    while end > 0 && b[end - 1] == 0 {
        end -= 1;
    }
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Validates a whole GGUF header against the bytes of the file (`bytes` is the full file).
///
/// Checks the magic and version (2 or 3), that the tensor and metadata counts could fit in
/// the file, every string and array length, value types, `general.alignment`, every tensor's
/// rank, dims, type and block divisibility, and that every tensor's data lies inside the
/// file. Allocates nothing in proportion to header fields.
pub fn scan(path: &Path, bytes: &[u8]) -> Result<ScanInfo> {
    let mut r = Reader { b: bytes, pos: 0, path };
    if bytes.len() < 4 || &bytes[..4] != b"GGUF" {
        return Err(Error::NotAModelFile {
            path: path.to_path_buf(),
            expected: "GGUF",
            detail: if bytes.is_empty() {
                "the file is empty".into()
            } else {
                format!("it does not start with the GGUF magic (found {:02x?})", &bytes[..bytes.len().min(4)])
            },
        });
    }
    r.pos = 4;
    let version = r.u32(&"version")?;
    if version != 2 && version != 3 {
        return Err(r.corrupt(format!(
            "unsupported GGUF version {version} (expected 2 or 3; big-endian files are not supported)"
        )));
    }
    let tensor_count = r.u64(&"tensor count")?;
    let kv_count = r.u64(&"metadata count")?;
    let rem = r.remaining() as u64;
    // A kv is at least an 8-byte key length, a 4-byte type and 1 byte of value; a tensor
    // info at least an 8-byte name length, rank, one dim, type and offset (32 bytes).
    let need = kv_count.checked_mul(13).and_then(|a| tensor_count.checked_mul(32).and_then(|b| a.checked_add(b)));
    if need.is_none_or(|n| n > rem) {
        return Err(r.corrupt(format!(
            "header declares {tensor_count} tensors and {kv_count} metadata entries, more than the {rem} bytes \
             after it can hold"
        )));
    }

    let mut alignment = gguf_file::DEFAULT_ALIGNMENT;
    for i in 0..kv_count {
        let key = gguf_str(r.string(&format_args!("key of metadata entry {i}"))?);
        let ty = r.u32(&format_args!("type of `{key}`"))?;
        if key == "general.alignment" {
            let start = r.pos;
            r.skip_value(ty, &key, 0)?;
            let raw = &bytes[start..r.pos];
            let v: Option<u64> = match ty {
                0 => Some(u64::from(raw[0])),
                1 => u64::try_from(raw[0] as i8).ok(),
                2 => Some(u64::from(u16::from_le_bytes([raw[0], raw[1]]))),
                3 => u64::try_from(i16::from_le_bytes([raw[0], raw[1]])).ok(),
                4 => Some(u64::from(u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))),
                5 => u64::try_from(i32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]])).ok(),
                _ => None,
            };
            match v {
                Some(a) if a.is_power_of_two() => alignment = a,
                _ => {
                    return Err(r.corrupt(format!(
                        "general.alignment must be a power-of-two 32-bit integer (type {ty}, bytes {raw:02x?})"
                    )))
                }
            }
        } else {
            r.skip_value(ty, &key, 0)?;
        }
    }

    struct Extent {
        name: String,
        offset: u64,
        size: u64,
    }
    let mut names = HashSet::new();
    let mut extents = Vec::new();
    for i in 0..tensor_count {
        let name = gguf_str(r.string(&format_args!("name of tensor {i}"))?);
        let what = format_args!("info of tensor `{name}`");
        let n_dims = r.u32(&what)?;
        if !(1..=4).contains(&n_dims) {
            return Err(r.corrupt(format!("tensor `{name}` has {n_dims} dimensions (expected 1 to 4)")));
        }
        let mut elems: u64 = 1;
        let mut ne0 = 0u64;
        for d in 0..n_dims {
            let n = r.u64(&what)?;
            if d == 0 {
                ne0 = n;
            }
            elems = match elems.checked_mul(n) {
                Some(e) if n > 0 => e,
                _ => return Err(r.corrupt(format!("tensor `{name}` has a bad dimension {n}"))),
            };
        }
        let type_id = r.u32(&what)?;
        let offset = r.u64(&what)?;
        let dtype = ggml_dtype(type_id).ok_or_else(|| Error::BadDtype {
            name: name.clone(),
            got: format!("ggml type {type_id}"),
            expected: "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K".into(),
        })?;
        let block = dtype.block_size() as u64;
        if ne0 % block != 0 {
            return Err(
                r.corrupt(format!("tensor `{name}` rows of {ne0} elements are not whole {dtype:?} blocks of {block}"))
            );
        }
        let size = (elems / block)
            .checked_mul(dtype.type_size() as u64)
            .ok_or_else(|| r.corrupt(format!("tensor `{name}` is too large")))?;
        if !names.insert(name.clone()) {
            return Err(r.corrupt(format!("tensor `{name}` appears twice")));
        }
        extents.push(Extent { name, offset, size });
    }
    let data = (r.pos as u64)
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| r.corrupt(format!("alignment {alignment} overflows")))?;
    let file_len = bytes.len() as u64;
    for e in &extents {
        if e.offset % alignment != 0 {
            return Err(r.corrupt(format!(
                "tensor `{}` data offset {} is not a multiple of the alignment {alignment}",
                e.name, e.offset
            )));
        }
        let end = data.checked_add(e.offset).and_then(|s| s.checked_add(e.size));
        if end.is_none_or(|end| end > file_len) {
            return Err(r.corrupt(format!(
                "tensor `{}` ({} bytes at data offset {}) runs past the end of the {file_len}-byte file",
                e.name, e.size, e.offset
            )));
        }
    }
    Ok(ScanInfo { version, tensor_count, kv_count, alignment, tensor_data_offset: data })
}

// ---------------------------------------------------------------------------------------------
// Row permutation
// ---------------------------------------------------------------------------------------------

fn head_rows(rows: usize, n_head: usize) -> Result<usize> {
    if n_head == 0 || rows % n_head != 0 || (rows / n_head) % 2 != 0 {
        return Err(Error::BadConfig(format!("{rows} rows do not split into {n_head} heads of even size")));
    }
    Ok(rows / n_head)
}

/// llama.cpp's permutation (`convert_hf_to_gguf.py` `permute`): GGUF row `r` is HF row
/// `index[r]`. Within each head, the two RoPE halves are interleaved.
pub fn llama_permute_index(rows: usize, n_head: usize) -> Result<Vec<usize>> {
    let hd = head_rows(rows, n_head)?;
    let half = hd / 2;
    let mut v = Vec::with_capacity(rows);
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                v.push(h * hd + j * half + i);
            }
        }
    }
    Ok(v)
}

/// The inverse of [`llama_permute_index`] (HF's `reverse_permute_weights`): HF row `r` is GGUF
/// row `index[r]`.
pub fn llama_unpermute_index(rows: usize, n_head: usize) -> Result<Vec<usize>> {
    let hd = head_rows(rows, n_head)?;
    let half = hd / 2;
    let mut v = Vec::with_capacity(rows);
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                v.push(h * hd + 2 * i + j);
            }
        }
    }
    Ok(v)
}

/// `out[r] = t[index[r]]` along dim 0 of a dense tensor (1-D or 2-D).
pub fn reorder_rows_dense(t: &Tensor, index: &[usize]) -> Result<Tensor> {
    let rows = t.dims().first().copied().unwrap_or(0);
    if index.len() != rows || index.iter().any(|&i| i >= rows) {
        return Err(Error::BadConfig(format!("row index of {} entries does not fit {rows} rows", index.len())));
    }
    let ix: Vec<u32> = index.iter().map(|&i| i as u32).collect();
    let ix = Tensor::from_vec(ix, rows, t.device())?;
    Ok(t.index_select(&ix, 0)?)
}

/// A QTensor from raw ggml bytes. The bytes are copied into an 8-byte-aligned buffer (the
/// block types need 2- or 4-byte alignment) and their length is checked against the shape.
pub fn qtensor_from_bytes(dtype: GgmlDType, bytes: &[u8], dims: &[usize]) -> Result<QTensor> {
    let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let block = dtype.block_size();
    let expected = elems.filter(|e| e % block == 0).and_then(|e| (e / block).checked_mul(dtype.type_size()));
    if expected != Some(bytes.len()) || dims.last().is_none_or(|&d| d % block != 0) {
        return Err(Error::InvalidInput(format!(
            "{} bytes do not hold a {dtype:?} tensor of shape {dims:?}",
            bytes.len()
        )));
    }
    let mut buf = vec![0u64; bytes.len().div_ceil(8)];
    let aligned = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf)[..bytes.len()];
    aligned.copy_from_slice(bytes);
    let storage = QStorage::from_data(Cow::Borrowed(aligned), &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, dims.to_vec())?)
}

/// `out[r] = q[index[r]]` for a 2-D quantized tensor, moving each row's bytes (the blocks of
/// a ggml tensor run along the last, input dimension, so a row is whole blocks).
pub fn reorder_rows_quantized(q: &QTensor, index: &[usize]) -> Result<QTensor> {
    let dims = q.shape().dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if dims.len() != 2 || index.len() != rows || index.iter().any(|&i| i >= rows) {
        return Err(Error::BadConfig(format!("cannot reorder rows of a {dims:?} tensor with {} indices", index.len())));
    }
    let data = q.data()?;
    let row_bytes = dims[1] / q.dtype().block_size() * q.dtype().type_size();
    if data.len() != rows * row_bytes {
        return Err(Error::BadConfig(format!("{dims:?} {:?} tensor holds {} bytes", q.dtype(), data.len())));
    }
    let mut out = vec![0u8; data.len()];
    for (dst, &src) in out.chunks_exact_mut(row_bytes).zip(index) {
        dst.copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    qtensor_from_bytes(q.dtype(), &out, &dims)
}

// ---------------------------------------------------------------------------------------------
// Metadata → config
// ---------------------------------------------------------------------------------------------

/// A GGUF metadata value as a non-negative integer, whatever integer type the file used.
pub(crate) fn value_as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(u64::from(x)),
        Value::U16(x) => Some(u64::from(x)),
        Value::U32(x) => Some(u64::from(x)),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn md_uint(md: &HashMap<String, Value>, key: &str) -> Result<Option<u64>> {
    let v = match md.get(key) {
        None => return Ok(None),
        Some(v) => v,
    };
    value_as_u64(v)
        .map(Some)
        .ok_or_else(|| Error::BadConfig(format!("`{key}` must be a non-negative integer, got {v:?}")))
}

fn md_usize(md: &HashMap<String, Value>, key: &str) -> Result<Option<usize>> {
    match md_uint(md, key)? {
        None => Ok(None),
        Some(n) => usize::try_from(n).map(Some).map_err(|_| Error::BadConfig(format!("`{key}` = {n} is too large"))),
    }
}

fn md_req(md: &HashMap<String, Value>, key: &str) -> Result<usize> {
    md_usize(md, key)?.ok_or_else(|| Error::BadConfig(format!("metadata `{key}` is missing")))
}

/// A float; an f32 goes through its shortest decimal form so `1e-5f32` reads as `1e-5`.
fn md_float(md: &HashMap<String, Value>, key: &str) -> Result<Option<f64>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::F32(x)) => Ok(Some(x.to_string().parse::<f64>().unwrap_or(*x as f64))),
        Some(Value::F64(x)) => Ok(Some(*x)),
        Some(_) => md_uint(md, key).map(|o| o.map(|n| n as f64)),
    }
}

fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(Error::BadConfig(format!("`{key}` must be a string, got {v:?}"))),
    }
}

/// The dtype of a GGUF file's weights by its `general.file_type` (llama.cpp's `llama_ftype`):
/// F32 (0), F16 (1) or BF16 (32); `None` for a quantized file or none said.
pub fn file_type_dtype(md: &HashMap<String, Value>) -> Option<DType> {
    match md.get("general.file_type").and_then(value_as_u64)? {
        0 => Some(DType::F32),
        1 => Some(DType::F16),
        32 => Some(DType::BF16),
        _ => None,
    }
}

fn token_u32(md: &HashMap<String, Value>, key: &str) -> Result<Option<u32>> {
    match md_uint(md, key)? {
        None => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| Error::BadConfig(format!("`{key}` = {n} is not a token id"))),
    }
}

/// The per-frequency divisors llama.cpp stores in `rope_freqs.weight` for Llama 3.1-style
/// scaling (`convert_hf_to_gguf.py`), or `None` without scaling.
pub fn llama3_rope_freq_factors(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let s = cfg.rope_scaling?;
    let mut base_cfg = cfg.clone();
    base_cfg.rope_scaling = None;
    let old = s.original_max_position_embeddings as f32;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    Some(
        base_cfg
            .rope_inv_freq()
            .into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    1.0 / ((1.0 - smooth) / s.factor + smooth)
                }
            })
            .collect(),
    )
}

/// Recovers Llama 3.1 scaling parameters from llama.cpp's `rope_freqs` divisors.
///
/// The divisors only fix the parameters up to a common scale of
/// (`original_max_position_embeddings`, `low_freq_factor`, `high_freq_factor`), so the
/// standard Llama 3.x values (1, 4, `orig_hint` or 8192) are tried first, then a fit with
/// `low_freq_factor = 1`. Whatever is returned reproduces the divisors (checked).
pub fn llama3_scaling_from_rope_freqs(
    cfg: &ModelConfig,
    factors: &[f32],
    orig_hint: Option<usize>,
) -> Result<Option<Llama3RopeScaling>> {
    let mut base_cfg = cfg.clone();
    base_cfg.rope_scaling = None;
    let base = base_cfg.rope_inv_freq();
    if factors.len() != base.len() {
        return Err(Error::BadConfig(format!(
            "{ROPE_FREQS} has {} entries, expected head_dim/2 = {}",
            factors.len(),
            base.len()
        )));
    }
    if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
        return Err(Error::BadConfig(format!("{ROPE_FREQS} holds non-positive or non-finite factors")));
    }
    if factors.iter().all(|&f| (f - 1.0).abs() <= 1e-6) {
        return Ok(None);
    }
    let factor = factors.iter().copied().fold(0.0f32, f32::max);
    let target: Vec<f32> = base.iter().zip(factors).map(|(b, f)| b / f).collect();
    let fits = |s: Llama3RopeScaling| -> bool {
        let mut c = base_cfg.clone();
        c.rope_scaling = Some(s);
        c.validate().is_ok() && c.rope_inv_freq().iter().zip(&target).all(|(a, b)| ((a - b) / b).abs() <= 1e-4)
    };
    let standard = Llama3RopeScaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: orig_hint.unwrap_or(8192),
    };
    if fits(standard) {
        return Ok(Some(standard));
    }
    // Inside the transition band the divisor d gives smooth = (1/d - 1/factor)/(1 - 1/factor),
    // which is linear in the frequency: smooth = α·f + β with (low = 1)
    // β = -1/(high - 1) and α = orig / (2π (high - 1)).
    let pts: Vec<(f64, f64)> = base
        .iter()
        .zip(factors)
        .filter(|(_, &d)| d > 1.0 + 1e-4 && d < factor * (1.0 - 1e-4))
        .map(|(&f, &d)| {
            let (d, fa) = (d as f64, factor as f64);
            (f as f64, (1.0 / d - 1.0 / fa) / (1.0 - 1.0 / fa))
        })
        .collect();
    if let (Some(&(f1, s1)), Some(&(f2, s2))) = (pts.first(), pts.last()) {
        if pts.len() >= 2 && f1 != f2 {
            let alpha = (s2 - s1) / (f2 - f1);
            let beta = s1 - alpha * f1;
            if beta < 0.0 && alpha > 0.0 {
                let snap = |x: f64| if (x - x.round()).abs() < 1e-3 { x.round() } else { x };
                let high = snap(1.0 - 1.0 / beta);
                let orig = (alpha * 2.0 * std::f64::consts::PI * (high - 1.0)).round();
                if (1.0..1e9).contains(&orig) {
                    let fitted = Llama3RopeScaling {
                        factor,
                        low_freq_factor: 1.0,
                        high_freq_factor: high as f32,
                        original_max_position_embeddings: orig as usize,
                    };
                    if fits(fitted) {
                        return Ok(Some(fitted));
                    }
                }
            }
        }
    }
    Err(Error::BadConfig(format!("{ROPE_FREQS} does not match any llama3 rope scaling")))
}

// ---------------------------------------------------------------------------------------------
// The file
// ---------------------------------------------------------------------------------------------

/// An open, validated GGUF file: its memory map and candle's parse of its header.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    content: gguf_file::Content,
    scan: ScanInfo,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.content.tensor_infos.len())
            .field("metadata", &self.content.metadata.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates a GGUF file and parses its header.
    ///
    /// The file is memory-mapped for as long as the returned `GgufFile` lives. Precondition:
    /// nothing modifies or truncates the file meanwhile. That cannot be checked; a file changed
    /// under the map breaks the immutability `&[u8]` promises (undefined behaviour), and one
    /// truncated under it kills the process with SIGBUS on the next read past the new end.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: `Mmap::map` is unsafe because the slice it returns is only sound while no
        // one writes to or truncates the file, which this process cannot enforce against other
        // processes. We rely on the precondition documented above (the model file is not
        // modified while it is loaded, as every memory-mapping loader does) and never write
        // through the map, which is read-only. Every offset into it is checked by `scan`
        // against the map's length before it is read.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let scan = scan(path, &mmap)?;
        let content = gguf_file::Content::read(&mut Cursor::new(&mmap[..]))
            .map_err(|e| Error::Corrupt { path: path.to_path_buf(), detail: e.to_string() })?;
        if content.tensor_data_offset != scan.tensor_data_offset
            || content.tensor_infos.len() as u64 != scan.tensor_count
        {
            return Err(Error::Corrupt {
                path: path.to_path_buf(),
                detail: "header parses inconsistently (duplicate names or alignment)".into(),
            });
        }
        Ok(GgufFile { path: path.to_path_buf(), mmap, content, scan })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header metadata (`general.*`, `{arch}.*`, `tokenizer.ggml.*`).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Takes the metadata out (for [`crate::load::ModelSource`]).
    pub fn into_metadata(self) -> HashMap<String, Value> {
        self.content.metadata
    }

    /// candle's parse of the header.
    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    /// What the validating scan found.
    pub fn scan_info(&self) -> &ScanInfo {
        &self.scan
    }

    /// True if the file holds a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor exactly as stored (no un-permutation).
    pub fn tensor(&self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::MissingTensor { path: self.path.clone(), name: name.into() });
        }
        self.content
            .tensor(&mut Cursor::new(&self.mmap[..]), name, &Device::Cpu)
            .map_err(|e| Error::Corrupt { path: self.path.clone(), detail: format!("tensor `{name}`: {e}") })
    }

    fn bad_config(&self, e: Error) -> Error {
        match e {
            Error::BadConfig(m) => Error::BadConfig(format!("{}: {m}", self.path.display())),
            e => e,
        }
    }

    /// The model config from the metadata (and the tensors present: tied embeddings, biases,
    /// llama.cpp's `rope_freqs`), validated.
    pub fn config(&self) -> Result<ModelConfig> {
        self.config_inner().map_err(|e| self.bad_config(e))
    }

    fn config_inner(&self) -> Result<ModelConfig> {
        let md = self.metadata();
        let arch_name = md_str(md, "general.architecture")?
            .ok_or_else(|| Error::BadConfig("general.architecture is missing".into()))?;
        let arch = Arch::parse(arch_name)?;
        let k = |s: &str| format!("{arch_name}.{s}");
        // Mixtral is arch `llama` with experts: refuse it by its key, before reading any tensor.
        if let Some(n) = md_usize(md, &k("expert_count"))?.filter(|&n| n > 0) {
            return Err(Error::BadConfig(format!("mixture-of-experts (expert_count {n}) is not supported")));
        }
        let hidden_size = md_req(md, &k("embedding_length"))?;
        let num_heads = md_req(md, &k("attention.head_count"))?;
        let num_kv_heads = md_usize(md, &k("attention.head_count_kv"))?.unwrap_or(num_heads);
        let head_dim = match md_usize(md, &k("attention.key_length"))? {
            Some(hd) => hd,
            None if num_heads > 0 && hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(Error::BadConfig(format!(
                "embedding_length {hidden_size} is not a multiple of head_count {num_heads} and no key_length is given"
            )))
            }
        };
        if let Some(vl) = md_usize(md, &k("attention.value_length"))? {
            if vl != head_dim {
                return Err(Error::BadConfig(format!("value_length {vl} differs from key_length {head_dim}")));
            }
        }
        if let Some(rd) = md_usize(md, &k("rope.dimension_count"))? {
            if rd != head_dim {
                return Err(Error::BadConfig(format!(
                    "partial RoPE (rope.dimension_count {rd} of head_dim {head_dim}) is not supported"
                )));
            }
        }
        // As llama.cpp reads them: the factor (or the older `rope.scale_linear`) scales positions
        // by 1/factor, 0 meaning none; a missing type is linear, and type `none` never scales.
        let factor_key = match md.contains_key(&k("rope.scaling.factor")) {
            true => k("rope.scaling.factor"),
            false => k("rope.scale_linear"),
        };
        let factor = md_float(md, &factor_key)?;
        match md_str(md, &k("rope.scaling.type"))? {
            Some("none") => {}
            Some(t) => return Err(Error::BadConfig(format!("rope scaling type `{t}` is not supported"))),
            None => {
                if let Some(f) = factor.filter(|&f| f != 0.0 && f != 1.0) {
                    return Err(Error::BadConfig(format!(
                        "`{factor_key}` {f} with no rope.scaling.type is linear RoPE scaling, which is not supported"
                    )));
                }
            }
        }
        let vocab_size = match md_usize(md, &k("vocab_size"))? {
            Some(v) => v,
            None => match md.get("tokenizer.ggml.tokens") {
                Some(Value::Array(a)) => a.len(),
                _ => self
                    .content
                    .tensor_infos
                    .get(&gguf_tensor_name(WeightName::Embed))
                    .and_then(|t| t.shape.dims().first().copied())
                    .ok_or_else(|| Error::BadConfig("cannot tell the vocabulary size".into()))?,
            },
        };
        let attention_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Mistral => false,
            Arch::Llama | Arch::Qwen3 => self.has_tensor(&gguf_tensor_name(WeightName::Layer(0, LayerWeight::QBias))),
        };
        let mut eos_token_ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = token_u32(md, key)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let mut cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: md_req(md, &k("feed_forward_length"))?,
            num_layers: md_req(md, &k("block_count"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: md_float(md, &k("rope.freq_base"))?.unwrap_or(10000.0) as f32,
            rope_scaling: None,
            // Both required, as llama.cpp requires them: a default would be a guess.
            rms_norm_eps: md_float(md, &k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| {
                Error::BadConfig(format!("metadata `{}` is missing", k("attention.layer_norm_rms_epsilon")))
            })?,
            max_position_embeddings: md_req(md, &k("context_length"))?,
            tie_word_embeddings: !self.has_tensor(&gguf_tensor_name(WeightName::LmHead)),
            attention_bias,
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: token_u32(md, "tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
        };
        cfg.validate()?;
        if self.has_tensor(ROPE_FREQS) {
            let t = self.tensor(ROPE_FREQS)?.dequantize(&Device::Cpu)?;
            if t.rank() != 1 {
                return Err(Error::BadConfig(format!("{ROPE_FREQS} has shape {:?}", t.dims())));
            }
            let factors = t.to_vec1::<f32>()?;
            let hint = md_usize(md, &k("rope.scaling.original_context_length"))?;
            cfg.rope_scaling = llama3_scaling_from_rope_freqs(&cfg, &factors, hint)?;
            cfg.validate()?;
        }
        Ok(cfg)
    }

    /// Loads every weight. `Quantized` keeps linear weights as stored (any ggml type) and
    /// dequantizes norms, biases and the embedding to f32; a tied LM head is then the
    /// embedding's stored (quantized) tensor. `Dense(dtype)` dequantizes everything.
    pub fn load_weights(&self, format: WeightFormat) -> Result<ModelWeights> {
        self.load_weights_with_progress(format, &mut |_, _| {})
    }

    /// [`GgufFile::load_weights`] reporting progress once per tensor.
    pub fn load_weights_with_progress(&self, format: WeightFormat, progress: Progress<'_>) -> Result<ModelWeights> {
        load::check_format(format)?;
        let cfg = self.config()?;
        let mut src = GgufSource {
            file: self,
            permute: arch_is_permuted(cfg.arch),
            quantized: format == WeightFormat::Quantized,
            embed_q: None,
            cfg: cfg.clone(),
        };
        load::assemble(&cfg, load::dense_dtype(format), &mut src, progress)
    }
}

struct GgufSource<'a> {
    file: &'a GgufFile,
    cfg: ModelConfig,
    permute: bool,
    quantized: bool,
    embed_q: Option<Arc<QTensor>>,
}

impl GgufSource<'_> {
    /// Reads a weight as stored, after checking its shape.
    fn read(&self, name: WeightName) -> Result<QTensor> {
        let file_name = gguf_tensor_name(name);
        let info = self
            .file
            .content
            .tensor_infos
            .get(&file_name)
            .ok_or_else(|| Error::MissingTensor { path: self.file.path.clone(), name: file_name.clone() })?;
        check_shape(&file_name, info.shape.dims(), &load::expected_shape(&self.cfg, name))?;
        self.file.tensor(&file_name)
    }

    /// The row order that undoes llama.cpp's permutation, for q/k weights and biases.
    fn unpermute(&self, name: WeightName) -> Result<Option<Vec<usize>>> {
        use LayerWeight::*;
        if !self.permute {
            return Ok(None);
        }
        let heads = match name {
            WeightName::Layer(_, Q | QBias) => self.cfg.num_heads,
            WeightName::Layer(_, K | KBias) => self.cfg.num_kv_heads,
            _ => return Ok(None),
        };
        llama_unpermute_index(load::expected_shape(&self.cfg, name)[0], heads).map(Some)
    }
}

impl WeightSource for GgufSource<'_> {
    fn dense(&mut self, name: WeightName, dtype: DType) -> Result<Tensor> {
        let q = self.read(name)?;
        let mut t = q.dequantize(&Device::Cpu)?;
        if let Some(ix) = self.unpermute(name)? {
            t = reorder_rows_dense(&t, &ix)?;
        }
        if name == WeightName::Embed && self.quantized && self.cfg.tie_word_embeddings {
            self.embed_q = Some(Arc::new(q));
        }
        Ok(if dtype == DType::F32 { t } else { t.to_dtype(dtype)? })
    }

    fn linear(&mut self, name: WeightName, dtype: DType) -> Result<Linear> {
        let q = self.read(name)?;
        let ix = self.unpermute(name)?;
        if self.quantized {
            let q = match ix {
                Some(ix) => reorder_rows_quantized(&q, &ix)?,
                None => q,
            };
            Ok(Linear::Quantized(Arc::new(q)))
        } else {
            let mut t = q.dequantize(&Device::Cpu)?;
            if let Some(ix) = ix {
                t = reorder_rows_dense(&t, &ix)?;
            }
            Ok(Linear::Dense(if dtype == DType::F32 { t } else { t.to_dtype(dtype)? }))
        }
    }

    fn tied_lm_head(&mut self, embed: &Tensor) -> Result<Linear> {
        Ok(match self.embed_q.take() {
            Some(q) => Linear::Quantized(q),
            None => Linear::Dense(embed.clone()),
        })
    }
}

/// Loads a GGUF file: its weights and its metadata. The file must not be modified or
/// truncated while it loads (see [`GgufFile::open`]).
pub fn load_gguf(path: &Path, format: WeightFormat) -> Result<(ModelWeights, HashMap<String, Value>)> {
    let f = GgufFile::open(path)?;
    let w = f.load_weights(format)?;
    Ok((w, f.into_metadata()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_indices_are_inverse() {
        for (rows, heads) in [(64, 4), (32, 2), (576, 9), (8, 1)] {
            let p = llama_permute_index(rows, heads).unwrap();
            let u = llama_unpermute_index(rows, heads).unwrap();
            for r in 0..rows {
                assert_eq!(p[u[r]], r);
                assert_eq!(u[p[r]], r);
            }
        }
        // One head of 4: HF rows [a0 a1 b0 b1] (halves a, b) become [a0 b0 a1 b1].
        assert_eq!(llama_permute_index(4, 1).unwrap(), vec![0, 2, 1, 3]);
        assert!(llama_permute_index(6, 4).is_err());
    }

    #[test]
    fn rope_freqs_fit_recovers_named_and_random_configs() {
        for cfg in [
            crate::synthetic::named_config("llama3.2-1b").unwrap(),
            crate::synthetic::random_config(Arch::Llama, false),
        ] {
            let f = llama3_rope_freq_factors(&cfg).unwrap();
            let s = llama3_scaling_from_rope_freqs(&cfg, &f, None).unwrap();
            assert_eq!(s, cfg.rope_scaling, "{cfg:?}");
        }
        let cfg = crate::synthetic::random_config(Arch::Llama, false);
        let ones = vec![1.0; cfg.head_dim / 2];
        assert_eq!(llama3_scaling_from_rope_freqs(&cfg, &ones, None).unwrap(), None);
        assert!(llama3_scaling_from_rope_freqs(&cfg, &[1.0, 2.0], None).is_err());
    }

    #[test]
    fn qtensor_bytes_round_trip() {
        let t = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let q2 = qtensor_from_bytes(q.dtype(), &q.data().unwrap(), &[4, 64]).unwrap();
        assert_eq!(q.data().unwrap(), q2.data().unwrap());
        assert!(qtensor_from_bytes(GgmlDType::Q8_0, &q.data().unwrap()[1..], &[4, 64]).is_err());
        assert!(qtensor_from_bytes(GgmlDType::Q8_0, &q.data().unwrap(), &[4, 48]).is_err());
    }
}
