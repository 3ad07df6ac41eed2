//! Loader tests: round trips through the synthetic writers, the llama.cpp q/k permutation,
//! and bad input of every kind (each must be a typed error naming the file, never a panic).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use ferrum_runner::config::{Arch, ModelConfig};
use ferrum_runner::error::Error;
use ferrum_runner::gguf::{self, GgufFile};
use ferrum_runner::load::{load_model, load_model_with_progress, weight_names, LoadedModel, ModelSource};
use ferrum_runner::synthetic::{
    dense_tensors, random_config, random_weights, write_gguf, write_hf_folder, write_hf_folder_sharded,
    GgufWriteOptions,
};
use ferrum_runner::weights::{Linear, ModelWeights, WeightFormat, WeightName};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};

const ARCHS: [Arch; 4] = [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3];
const F32: WeightFormat = WeightFormat::Dense(DType::F32);

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Every weight of `got` equals `want` (after rounding `want` through `via`) within `tol`.
fn assert_same_weights(got: &ModelWeights, want: &ModelWeights, via: DType, tol: f32, what: &str) {
    assert_eq!(got.config, want.config, "{what}: config");
    let g = dense_tensors(got).unwrap();
    let w = dense_tensors(want).unwrap();
    assert_eq!(g.len(), w.len());
    for ((gn, gt), (wn, wt)) in g.iter().zip(&w) {
        assert_eq!(gn, wn);
        let wt = wt.to_dtype(via).unwrap();
        let d = max_diff(gt, &wt);
        assert!(d <= tol, "{what}: {gn:?} differs by {d}");
    }
    // A tied head must be the embedding again.
    if got.config.tie_word_embeddings {
        let d = max_diff(&got.lm_head.to_dense(DType::F32).unwrap(), &got.embed);
        assert!(d <= tol.max(0.02), "{what}: tied lm_head differs from embed by {d}");
    }
}

fn err_mentions(e: &Error, needle: &str) {
    let msg = e.to_string();
    assert!(msg.contains(needle), "error `{msg}` does not mention `{needle}`");
}

fn path_str(p: &Path) -> String {
    p.display().to_string()
}

fn load_err(path: &Path, format: WeightFormat) -> Error {
    match load_model(path, format) {
        Ok(m) => panic!("{} loaded but should not have: {:?}", path.display(), m.weights.config),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------------

#[test]
fn hf_round_trip_every_arch() {
    for arch in ARCHS {
        for tied in [false, true] {
            let w = random_weights(&random_config(arch, tied), DType::F32, 11).unwrap();
            let dir = tmp();
            write_hf_folder(&w, dir.path(), DType::F32).unwrap();
            let m = load_model(dir.path(), F32).unwrap();
            assert!(matches!(m.source, ModelSource::HfDir { ref path } if path == dir.path()));
            assert!(m.source.gguf_metadata().is_none());
            assert_eq!(m.weights.dtype, DType::F32);
            assert_same_weights(&m.weights, &w, DType::F32, 0.0, &format!("hf {arch:?} tied={tied}"));
            // Quantized on an HF folder is documented as dense f32.
            let q = load_model(dir.path(), WeightFormat::Quantized).unwrap();
            assert!(matches!(q.weights.layers[0].q, Linear::Dense(_)));
            assert_same_weights(&q.weights, &w, DType::F32, 0.0, "hf quantized→f32");
        }
    }
}

#[test]
fn hf_round_trip_half_dtypes_and_shards() {
    let w = random_weights(&random_config(Arch::Qwen2, false), DType::F32, 5).unwrap();
    for (file_dtype, load_dtype) in
        [(DType::F16, DType::F16), (DType::BF16, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::F16)]
    {
        let dir = tmp();
        write_hf_folder(&w, dir.path(), file_dtype).unwrap();
        let m = load_model(dir.path(), WeightFormat::Dense(load_dtype)).unwrap();
        assert_eq!(m.weights.embed.dtype(), load_dtype);
        assert!(matches!(&m.weights.layers[1].up, Linear::Dense(t) if t.dtype() == load_dtype));
        // Rounded once through the narrower of the two dtypes: exact.
        let via = if file_dtype == DType::F32 { load_dtype } else { file_dtype };
        assert_same_weights(&m.weights, &w, via, 0.0, &format!("{file_dtype:?}->{load_dtype:?}"));
    }
    // Sharded folder: several files and an index, like save_pretrained.
    let dir = tmp();
    write_hf_folder_sharded(&w, dir.path(), DType::F32, Some(40_000)).unwrap();
    let shards = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors"))
        .count();
    assert!(shards >= 3, "{shards} shards");
    assert!(!dir.path().join("model.safetensors").exists());
    let m = load_model(dir.path(), F32).unwrap();
    assert_same_weights(&m.weights, &w, DType::F32, 0.0, "sharded");
    // A path to a shard or to config.json loads the folder too.
    let m = load_model(&dir.path().join("config.json"), F32).unwrap();
    assert_eq!(m.source.path(), dir.path());
}

#[test]
fn gguf_round_trip_every_arch() {
    for arch in ARCHS {
        for tied in [false, true] {
            let w = random_weights(&random_config(arch, tied), DType::F32, 3).unwrap();
            let dir = tmp();
            let path = dir.path().join("m.gguf");
            write_gguf(&w, &path, &GgufWriteOptions::default()).unwrap();
            let what = format!("gguf {arch:?} tied={tied}");
            let m = load_model(&path, F32).unwrap();
            assert!(m.source.is_gguf());
            assert_eq!(m.source.path(), path);
            let md = m.source.gguf_metadata().unwrap();
            assert!(matches!(md.get("general.architecture"), Some(Value::String(s)) if s == arch.name()));
            assert_same_weights(&m.weights, &w, DType::F32, 0.0, &what);
            // Quantized format on f32 tensors keeps them as (f32) QTensors, un-permuted the same way.
            let q = load_model(&path, WeightFormat::Quantized).unwrap();
            assert!(matches!(q.weights.layers[0].k, Linear::Quantized(_)));
            assert_same_weights(&q.weights, &w, DType::F32, 0.0, &format!("{what} quantized"));
            // f16 load.
            let h = load_model(&path, WeightFormat::Dense(DType::F16)).unwrap();
            assert_same_weights(&h.weights, &w, DType::F16, 0.0, &format!("{what} f16"));
        }
    }
}

#[test]
fn gguf_f16_tensors_and_vocab_size_key() {
    let w = random_weights(&random_config(Arch::Llama, false), DType::F32, 9).unwrap();
    let dir = tmp();
    let path = dir.path().join("m.gguf");
    let opts = GgufWriteOptions { linear: GgmlDType::F16, embed: GgmlDType::F16, tokens: false };
    write_gguf(&w, &path, &opts).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert!(f.metadata().contains_key("llama.vocab_size"));
    assert!(!f.metadata().contains_key("tokenizer.ggml.tokens"));
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().dtype(), GgmlDType::F16);
    let m = f.load_weights(F32).unwrap();
    // Linears and the embedding went through f16; norms stayed f32.
    let g = dense_tensors(&m).unwrap();
    for (name, t) in dense_tensors(&w).unwrap() {
        let via =
            if name != WeightName::Embed && !ferrum_runner::load::is_linear(name) { DType::F32 } else { DType::F16 };
        let got = &g.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(max_diff(got, &t.to_dtype(via).unwrap()), 0.0, "{name:?}");
    }
}

#[test]
fn gguf_metadata_gives_config_and_tokenizer() {
    let cfg = random_config(Arch::Llama, true);
    let w = random_weights(&cfg, DType::F32, 1).unwrap();
    let dir = tmp();
    let path = dir.path().join("m.gguf");
    write_gguf(&w, &path, &GgufWriteOptions::default()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    // Llama 3.1 RoPE scaling travels as llama.cpp's rope_freqs tensor and is recovered.
    assert!(f.has_tensor(gguf::ROPE_FREQS));
    assert_eq!(f.config().unwrap(), cfg);
    assert!(cfg.rope_scaling.is_some());
    let md = f.metadata();
    assert!(matches!(md.get("tokenizer.ggml.tokens"), Some(Value::Array(a)) if a.len() == cfg.vocab_size));
    assert!(matches!(md.get("tokenizer.ggml.bos_token_id"), Some(Value::U32(1))));
    let tok = ferrum_runner::tokenizer::Tokenizer::from_gguf_metadata(md).unwrap();
    let ids = tok.encode("hello world", false).unwrap();
    assert!(!ids.is_empty() && ids.iter().all(|&i| (i as usize) < cfg.vocab_size), "{ids:?}");
}

#[test]
fn progress_is_reported_per_tensor() {
    let w = random_weights(&random_config(Arch::Qwen3, false), DType::F32, 2).unwrap();
    let dir = tmp();
    write_hf_folder(&w, dir.path(), DType::F32).unwrap();
    let path = dir.path().join("m.gguf");
    write_gguf(&w, &path, &GgufWriteOptions::default()).unwrap();
    let n = weight_names(&w.config).len();
    for p in [dir.path().to_path_buf(), path] {
        let mut calls = Vec::new();
        load_model_with_progress(&p, F32, &mut |done, total| calls.push((done, total))).unwrap();
        assert_eq!(calls.len(), n);
        assert_eq!(calls.last(), Some(&(n, n)));
    }
}

// ---------------------------------------------------------------------------------------------
// The llama.cpp q/k permutation
// ---------------------------------------------------------------------------------------------

/// llama.cpp's `permute`, written independently with reshapes:
/// `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)`.
fn llama_cpp_permute(w: &Tensor, n_head: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((n_head, 2, rows / n_head / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

/// HF's `reverse_permute_weights`: `w.reshape(n_head, dim, 2, cols).swapaxes(2, 1).reshape(w.shape)`.
fn hf_reverse_permute(w: &Tensor, n_head: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((n_head, rows / n_head / 2, 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

#[test]
fn gguf_unpermutes_dense_llama_qk() {
    for arch in [Arch::Llama, Arch::Mistral, Arch::Qwen2] {
        let cfg = random_config(arch, false);
        let w = random_weights(&cfg, DType::F32, 21).unwrap();
        let dir = tmp();
        let path = dir.path().join("m.gguf");
        write_gguf(&w, &path, &GgufWriteOptions::default()).unwrap();
        let f = GgufFile::open(&path).unwrap();
        for layer in 0..cfg.num_layers {
            let orig_q = w.layers[layer].q.to_dense(DType::F32).unwrap();
            let orig_k = w.layers[layer].k.to_dense(DType::F32).unwrap();
            let stored_q = f.tensor(&format!("blk.{layer}.attn_q.weight")).unwrap().dequantize(&Device::Cpu).unwrap();
            let stored_k = f.tensor(&format!("blk.{layer}.attn_k.weight")).unwrap().dequantize(&Device::Cpu).unwrap();
            if arch == Arch::Qwen2 {
                // llama.cpp uses NEOX RoPE for Qwen2: stored as in HF.
                assert_eq!(max_diff(&stored_q, &orig_q), 0.0);
            } else {
                // The file holds exactly what llama.cpp's converter writes...
                assert_eq!(max_diff(&stored_q, &llama_cpp_permute(&orig_q, cfg.num_heads)), 0.0);
                assert_eq!(max_diff(&stored_k, &llama_cpp_permute(&orig_k, cfg.num_kv_heads)), 0.0);
                assert!(max_diff(&stored_q, &orig_q) > 0.0, "permutation must move rows");
            }
            // ...and loading gives back HF layout.
            let m = f.load_weights(F32).unwrap();
            assert_eq!(max_diff(&m.layers[layer].q.to_dense(DType::F32).unwrap(), &orig_q), 0.0);
            assert_eq!(max_diff(&m.layers[layer].k.to_dense(DType::F32).unwrap(), &orig_k), 0.0);
        }
    }
}

#[test]
fn gguf_unpermutes_quantized_llama_qk_by_rows() {
    let cfg = random_config(Arch::Llama, true);
    let w = random_weights(&cfg, DType::F32, 4).unwrap();
    let dir = tmp();
    let path = dir.path().join("m.gguf");
    let opts = GgufWriteOptions { linear: GgmlDType::Q8_0, embed: GgmlDType::Q8_0, tokens: true };
    write_gguf(&w, &path, &opts).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let m = load_model(&path, WeightFormat::Quantized).unwrap().weights;
    let d = load_model(&path, F32).unwrap().weights;
    for layer in 0..cfg.num_layers {
        for (lw, heads, name) in [(0, cfg.num_heads, "attn_q"), (1, cfg.num_kv_heads, "attn_k")] {
            let stored = f.tensor(&format!("blk.{layer}.{name}.weight")).unwrap();
            assert_eq!(stored.dtype(), GgmlDType::Q8_0);
            let l = &m.layers[layer];
            let loaded = if lw == 0 { &l.q } else { &l.k };
            let Linear::Quantized(q) = loaded else { panic!("{name} should stay quantized") };
            assert_eq!(q.dtype(), GgmlDType::Q8_0);
            // Reordering quantized rows == dequantize, then un-permute: exactly.
            let want = hf_reverse_permute(&stored.dequantize(&Device::Cpu).unwrap(), heads);
            assert_eq!(max_diff(&q.dequantize(&Device::Cpu).unwrap(), &want), 0.0, "{name}");
            // The dense load agrees, and both are close to the original weights.
            let dl = if lw == 0 { &d.layers[layer].q } else { &d.layers[layer].k };
            assert_eq!(max_diff(&dl.to_dense(DType::F32).unwrap(), &want), 0.0);
            let orig = if lw == 0 { &w.layers[layer].q } else { &w.layers[layer].k };
            let err = max_diff(&want, &orig.to_dense(DType::F32).unwrap());
            assert!(err < 0.01, "{name} Q8_0 error {err}");
        }
    }
    // Tied + quantized: the LM head is the stored (quantized) embedding; the embedding is dense f32.
    let Linear::Quantized(head) = &m.lm_head else { panic!("tied quantized head should be quantized") };
    assert_eq!(head.dtype(), GgmlDType::Q8_0);
    assert_eq!(m.embed.dtype(), DType::F32);
    assert_eq!(max_diff(&head.dequantize(&Device::Cpu).unwrap(), &m.embed), 0.0);
    // A quantized model runs through candle's quantized matmul.
    let x = Tensor::ones((1, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    let y = candle_core::Module::forward(&m.layers[0].q.qmatmul().unwrap(), &x).unwrap();
    assert_eq!(y.dims(), &[1, cfg.q_dim()]);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_path_is_io_error_naming_it() {
    let dir = tmp();
    let p = dir.path().join("nope.gguf");
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::Io { ref path, .. } if path == &p), "{e}");
    err_mentions(&e, &path_str(&p));
}

#[test]
fn not_a_model_file() {
    let dir = tmp();
    let cases: [(&str, Vec<u8>); 4] = [
        ("random.bin", (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect()),
        ("notes.txt", b"this is a text file, not a model\n".to_vec()),
        ("empty.gguf", vec![]),
        ("tiny.gguf", b"GG".to_vec()),
    ];
    for (name, bytes) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = load_err(&p, F32);
        assert!(matches!(e, Error::NotAModelFile { .. }), "{name}: {e}");
        err_mentions(&e, &path_str(&p));
        // The GGUF reader alone says the same.
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, Error::NotAModelFile { expected: "GGUF", .. }), "{name}: {e}");
    }
    // A bare safetensors file with no config.json beside it.
    let w = random_weights(&random_config(Arch::Llama, true), DType::F32, 0).unwrap();
    let src = tmp();
    write_hf_folder(&w, src.path(), DType::F32).unwrap();
    let p = dir.path().join("model.safetensors");
    std::fs::copy(src.path().join("model.safetensors"), &p).unwrap();
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::NotAModelFile { .. }), "{e}");
    err_mentions(&e, &path_str(&p));
    err_mentions(&e, "config.json");
    // A folder without config.json, and one with a config but no weights.
    let empty = tmp();
    let e = load_err(empty.path(), F32);
    assert!(matches!(e, Error::Io { ref path, .. } if path.ends_with("config.json")), "{e}");
    std::fs::copy(src.path().join("config.json"), empty.path().join("config.json")).unwrap();
    let e = load_err(empty.path(), F32);
    assert!(matches!(e, Error::NotAModelFile { .. }), "{e}");
    err_mentions(&e, &path_str(empty.path()));
    // An unsupported dense dtype.
    let e = load_err(src.path(), WeightFormat::Dense(DType::U8));
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
}

fn synthetic_gguf(dir: &Path, arch: Arch) -> (PathBuf, Vec<u8>) {
    let w = random_weights(&random_config(arch, false), DType::F32, 8).unwrap();
    let path = dir.join("good.gguf");
    let opts = GgufWriteOptions { linear: GgmlDType::Q8_0, embed: GgmlDType::F16, tokens: true };
    write_gguf(&w, &path, &opts).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

/// Byte positions of interesting header fields of a valid GGUF (v2/v3).
#[derive(Debug, Default)]
struct Layout {
    first_key_len: usize,
    tokens_array_len: Option<usize>,
    alignment_value: Option<usize>,
    /// (name, position of its first dim, its type field, its offset field)
    tensors: Vec<(String, usize, usize, usize)>,
    header_end: usize,
}

fn layout(b: &[u8]) -> Layout {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
    fn skip(b: &[u8], p: &mut usize, ty: u32) {
        let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => *p += 1,
            2 | 3 => *p += 2,
            4..=6 => *p += 4,
            10..=12 => *p += 8,
            8 => *p += 8 + u64_at(*p),
            9 => {
                let et = u32_at(*p);
                let n = u64_at(*p + 4);
                *p += 12;
                for _ in 0..n {
                    skip(b, p, et);
                }
            }
            _ => panic!("bad type"),
        }
    }
    let n_t = u64_at(8);
    let n_kv = u64_at(16);
    let mut l = Layout { first_key_len: 24, ..Default::default() };
    let mut p = 24;
    for _ in 0..n_kv {
        let kl = u64_at(p);
        let key = String::from_utf8(b[p + 8..p + 8 + kl].to_vec()).unwrap();
        p += 8 + kl;
        let ty = u32_at(p);
        p += 4;
        if key == "tokenizer.ggml.tokens" {
            l.tokens_array_len = Some(p + 4);
        }
        if key == "general.alignment" {
            l.alignment_value = Some(p);
        }
        skip(b, &mut p, ty);
    }
    for _ in 0..n_t {
        let nl = u64_at(p);
        let name = String::from_utf8(b[p + 8..p + 8 + nl].to_vec()).unwrap();
        p += 8 + nl;
        let nd = u32_at(p) as usize;
        let dims = p + 4;
        p += 4 + 8 * nd;
        l.tensors.push((name, dims, p, p + 4));
        p += 12;
    }
    l.header_end = p;
    l
}

fn patch(bytes: &[u8], at: usize, new: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[at..at + new.len()].copy_from_slice(new);
    b
}

/// Writes `bytes` to `name` and loads it; it must fail fast with an error naming the file.
fn assert_rejected(dir: &Path, name: &str, bytes: &[u8]) -> Error {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    let t = Instant::now();
    let e = load_err(&p, WeightFormat::Quantized);
    assert!(t.elapsed() < Duration::from_secs(5), "{name}: took {:?}", t.elapsed());
    let msg = e.to_string();
    let named = msg.contains(&path_str(&p));
    assert!(
        named || matches!(e, Error::BadShape { .. } | Error::BadDtype { .. }),
        "{name}: `{msg}` does not name the file"
    );
    e
}

#[test]
fn truncated_gguf_always_errors() {
    let dir = tmp();
    let (good, bytes) = synthetic_gguf(dir.path(), Arch::Llama);
    assert!(load_model(&good, WeightFormat::Quantized).is_ok());
    let l = layout(&bytes);
    // Every cut inside the header, through the pure scanner (fast)...
    for cut in 0..l.header_end + 40 {
        let r = gguf::scan(&good, &bytes[..cut]);
        assert!(
            matches!(r, Err(Error::Corrupt { .. } | Error::NotAModelFile { .. })),
            "cut at {cut}: {:?}",
            r.map(|_| ())
        );
    }
    // ...and a sample of cuts through the whole loader, header and data.
    let mut cuts: Vec<usize> = (0..l.header_end).step_by(97).collect();
    cuts.extend((l.header_end..bytes.len()).step_by(1511));
    cuts.extend([1, 3, 4, 8, 23, 24, l.header_end, bytes.len() - 1]);
    for cut in cuts {
        let e = assert_rejected(dir.path(), "cut.gguf", &bytes[..cut]);
        assert!(matches!(e, Error::Corrupt { .. } | Error::NotAModelFile { .. }), "cut at {cut}: {e}");
    }
}

#[test]
fn gguf_header_sizes_past_the_end() {
    let dir = tmp();
    let (_, bytes) = synthetic_gguf(dir.path(), Arch::Qwen2);
    let l = layout(&bytes);
    let huge = (u64::MAX / 3).to_le_bytes();
    let big = (1u64 << 40).to_le_bytes();
    let (_, dims0, ty0, off0) = l.tensors[0].clone();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("tensor count", patch(&bytes, 8, &huge)),
        ("tensor count 2^40", patch(&bytes, 8, &big)),
        ("kv count", patch(&bytes, 16, &huge)),
        ("kv count 2^40", patch(&bytes, 16, &big)),
        ("key length", patch(&bytes, l.first_key_len, &huge)),
        ("key length 2^40", patch(&bytes, l.first_key_len, &big)),
        ("tokens array length", patch(&bytes, l.tokens_array_len.unwrap(), &huge)),
        ("tokens array length 2^40", patch(&bytes, l.tokens_array_len.unwrap(), &big)),
        ("tensor dim", patch(&bytes, dims0, &big)),
        ("tensor dim overflow", patch(&patch(&bytes, dims0, &huge), dims0 + 8, &huge)),
        ("tensor offset", patch(&bytes, off0, &huge)),
        ("tensor offset 2^40", patch(&bytes, off0, &big)),
        ("tensor offset unaligned", patch(&bytes, off0, &7u64.to_le_bytes())),
        ("tensor rank", patch(&bytes, dims0 - 4, &9u32.to_le_bytes())),
        ("version 1", patch(&bytes, 4, &1u32.to_le_bytes())),
        ("version 7", patch(&bytes, 4, &7u32.to_le_bytes())),
        ("big-endian version", patch(&bytes, 4, &3u32.to_be_bytes())),
        ("value type", patch(&bytes, l.first_key_len + 8 + 20, &[0xff; 4])),
        ("tensor type", patch(&bytes, ty0, &200u32.to_le_bytes())),
    ];
    for (what, b) in cases {
        let e = assert_rejected(dir.path(), "bad.gguf", &b);
        assert!(
            matches!(e, Error::Corrupt { .. } | Error::BadDtype { .. } | Error::BadConfig(_) | Error::BadShape { .. }),
            "{what}: {e}"
        );
    }
    // Version 3 has the same layout as 2 and loads.
    let p = dir.path().join("v3.gguf");
    std::fs::write(&p, patch(&bytes, 4, &3u32.to_le_bytes())).unwrap();
    assert_eq!(GgufFile::open(&p).unwrap().scan_info().version, 3);
    // An unsupported-but-valid ggml type is a dtype error naming the tensor.
    let e = assert_rejected(dir.path(), "iq.gguf", &patch(&bytes, ty0, &23u32.to_le_bytes()));
    assert!(matches!(e, Error::BadDtype { ref name, .. } if *name == l.tensors[0].0), "{e}");
    // So are Q8_1 and Q8_K: candle knows them as types but cannot load them from a file.
    for id in [9u32, 15] {
        let e = assert_rejected(dir.path(), "q8.gguf", &patch(&bytes, ty0, &id.to_le_bytes()));
        assert!(matches!(e, Error::BadDtype { ref name, .. } if *name == l.tensors[0].0), "type {id}: {e}");
    }
}

#[test]
fn gguf_header_fuzz_never_panics() {
    let dir = tmp();
    let (_, bytes) = synthetic_gguf(dir.path(), Arch::Qwen3);
    let header_end = layout(&bytes).header_end;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for i in 0..300 {
        let mut b = bytes.clone();
        let at = (next() as usize) % header_end;
        match i % 3 {
            0 => b[at] ^= 1 << (next() % 8),
            1 => b[at] = next() as u8,
            _ => {
                let v = next().to_le_bytes();
                let n = (b.len() - at).min(8);
                b[at..at + n].copy_from_slice(&v[..n]);
            }
        }
        let p = dir.path().join("fuzz.gguf");
        std::fs::write(&p, &b).unwrap();
        // Any result is fine (a flip in a float may still load); a panic is not.
        let _ = load_model(&p, WeightFormat::Quantized);
    }
}

#[test]
fn gguf_bad_alignment_is_rejected() {
    // candle divides by general.alignment: 0 must be caught before it.
    let dir = tmp();
    let (good, _) = synthetic_gguf(dir.path(), Arch::Llama);
    for (v, name) in [(Value::U32(0), "zero"), (Value::U32(48), "not a power of two"), (Value::U64(32), "u64")] {
        let p = dir.path().join("align.gguf");
        rewrite_gguf(&good, &p, |md, _| md.push(("general.alignment".into(), v.clone())));
        let e = load_err(&p, F32);
        assert!(matches!(e, Error::Corrupt { .. }), "{name}: {e}");
        err_mentions(&e, "alignment");
        err_mentions(&e, &path_str(&p));
    }
    // 64 is a legal alignment, but the tensors were laid out for 32.
    let p = dir.path().join("align64.gguf");
    rewrite_gguf(&good, &p, |md, _| md.push(("general.alignment".into(), Value::U32(64))));
    assert!(load_model(&p, F32).is_err());
}

/// Reads a GGUF with candle, lets `f` edit metadata and tensors, writes it back.
fn rewrite_gguf(src: &Path, dst: &Path, f: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>)) {
    let mut file = std::fs::File::open(src).unwrap();
    let c = gguf_file::Content::read(&mut file).unwrap();
    let mut md: Vec<(String, Value)> = c.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let mut ts: Vec<(String, QTensor)> =
        names.into_iter().map(|n| (n.clone(), c.tensor(&mut file, n, &Device::Cpu).unwrap())).collect();
    f(&mut md, &mut ts);
    let mut out = std::io::BufWriter::new(std::fs::File::create(dst).unwrap());
    let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &mdr, &tr).unwrap();
}

#[test]
fn gguf_missing_wrong_and_unknown() {
    let dir = tmp();
    let (good, _) = synthetic_gguf(dir.path(), Arch::Qwen2);
    // Missing tensor.
    let p = dir.path().join("missing.gguf");
    rewrite_gguf(&good, &p, |_, ts| ts.retain(|(n, _)| n != "blk.1.ffn_up.weight"));
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::MissingTensor { ref name, .. } if name == "blk.1.ffn_up.weight"), "{e}");
    err_mentions(&e, &path_str(&p));
    // Missing Qwen2 bias.
    rewrite_gguf(&good, &p, |_, ts| ts.retain(|(n, _)| n != "blk.0.attn_v.bias"));
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::MissingTensor { ref name, .. } if name == "blk.0.attn_v.bias"), "{e}");
    // Wrong shape.
    let p = dir.path().join("shape.gguf");
    rewrite_gguf(&good, &p, |_, ts| {
        for (n, t) in ts.iter_mut() {
            if n == "blk.0.attn_k.weight" {
                *t = QTensor::quantize(&Tensor::zeros((48, 64), DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32)
                    .unwrap();
            }
        }
    });
    let e = load_err(&p, F32);
    assert!(
        matches!(e, Error::BadShape { ref name, ref got, ref expected } if name == "blk.0.attn_k.weight" && got == &[48, 64] && expected == &[32, 64]),
        "{e}"
    );
    err_mentions(&e, "blk.0.attn_k.weight");
    // Unknown architecture.
    let p = dir.path().join("gpt2.gguf");
    rewrite_gguf(&good, &p, |md, _| {
        for (k, v) in md.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String("gpt2".into());
            }
        }
    });
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::UnknownArchitecture(ref a) if a == "gpt2"), "{e}");
    // Missing required metadata names the key and the file.
    let p = dir.path().join("nokey.gguf");
    rewrite_gguf(&good, &p, |md, _| md.retain(|(k, _)| k != "qwen2.block_count"));
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::BadConfig(_)), "{e}");
    err_mentions(&e, "qwen2.block_count");
    err_mentions(&e, &path_str(&p));
    // Absurd sizes in metadata are rejected by validate() before any allocation.
    rewrite_gguf(&good, &p, |md, _| {
        for (k, v) in md.iter_mut() {
            if k == "qwen2.embedding_length" {
                *v = Value::U64(1 << 40);
            }
        }
    });
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::BadConfig(_)), "{e}");
}

/// `good` with metadata `key` set to `v` (added, or replacing the value there).
fn with_key(good: &Path, dst: &Path, key: &str, v: Value) {
    rewrite_gguf(good, dst, |md, _| {
        md.retain(|(k, _)| k != key);
        md.push((key.into(), v));
    });
}

#[test]
fn gguf_mixture_of_experts_is_refused_before_any_tensor() {
    // A Mixtral GGUF is arch `llama` with `llama.expert_count`; its expert tensors
    // (`ffn_gate_exps`, ...) would otherwise end the load with a missing `ffn_gate` after
    // reading part of the file. Here every dense tensor is present, so only the key can refuse it.
    let dir = tmp();
    let (good, _) = synthetic_gguf(dir.path(), Arch::Llama);
    let p = dir.path().join("moe.gguf");
    with_key(&good, &p, "llama.expert_count", Value::U32(8));
    let e = load_err(&p, F32);
    assert!(matches!(e, Error::BadConfig(_)), "{e}");
    err_mentions(&e, "mixture-of-experts (expert_count 8) is not supported");
    err_mentions(&e, &path_str(&p));
    assert!(matches!(GgufFile::open(&p).unwrap().config(), Err(Error::BadConfig(_))));
    // expert_count 0 is a dense model.
    with_key(&good, &p, "llama.expert_count", Value::U32(0));
    load_model(&p, F32).unwrap();
}

#[test]
fn gguf_rope_scaling_factor_without_a_type_is_linear_scaling() {
    // llama.cpp reads a missing rope.scaling.type as linear and scales by 1/factor (0 = none);
    // type `none` turns any factor off.
    let dir = tmp();
    let (good, _) = synthetic_gguf(dir.path(), Arch::Llama);
    let p = dir.path().join("scaled.gguf");
    for key in ["llama.rope.scaling.factor", "llama.rope.scale_linear"] {
        with_key(&good, &p, key, Value::F32(4.0));
        let e = load_err(&p, F32);
        assert!(matches!(e, Error::BadConfig(_)), "{key}: {e}");
        err_mentions(&e, key);
        err_mentions(&e, &path_str(&p));
        for ok in [1.0, 0.0] {
            with_key(&good, &p, key, Value::F32(ok));
            load_model(&p, F32).unwrap_or_else(|e| panic!("{key} {ok}: {e}"));
        }
        let none = dir.path().join("none.gguf");
        with_key(&good, &p, key, Value::F32(4.0));
        with_key(&p, &none, "llama.rope.scaling.type", Value::String("none".into()));
        load_model(&none, F32).unwrap_or_else(|e| panic!("{key} with type none: {e}"));
        let linear = dir.path().join("linear.gguf");
        with_key(&p, &linear, "llama.rope.scaling.type", Value::String("linear".into()));
        err_mentions(&load_err(&linear, F32), "linear");
    }
    with_key(&good, &p, "llama.rope.scaling.factor", Value::String("4".into()));
    err_mentions(&load_err(&p, F32), "llama.rope.scaling.factor");
}

#[test]
fn gguf_context_length_and_rms_epsilon_are_required() {
    // llama.cpp refuses a file without either; a silent 2048 or 1e-5 would be a guess.
    let dir = tmp();
    for arch in ARCHS {
        let (good, _) = synthetic_gguf(dir.path(), arch);
        for key in ["context_length", "attention.layer_norm_rms_epsilon"] {
            let key = format!("{}.{key}", arch.name());
            let p = dir.path().join("nokey.gguf");
            rewrite_gguf(&good, &p, |md, _| md.retain(|(k, _)| *k != key));
            let e = load_err(&p, F32);
            assert!(matches!(e, Error::BadConfig(_)), "{key}: {e}");
            err_mentions(&e, &format!("`{key}` is missing"));
            err_mentions(&e, &path_str(&p));
        }
    }
}

/// Rewrites `dir/model.safetensors` through `f` (name, dtype, shape, bytes).
fn rewrite_safetensors(dir: &Path, f: impl FnOnce(&mut Vec<(String, StDtype, Vec<usize>, Vec<u8>)>)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    f(&mut ts);
    let views: Vec<(String, TensorView<'_>)> =
        ts.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &p).unwrap();
}

fn hf_dir(arch: Arch) -> tempfile::TempDir {
    let w = random_weights(&random_config(arch, false), DType::F32, 6).unwrap();
    let dir = tmp();
    write_hf_folder(&w, dir.path(), DType::F32).unwrap();
    dir
}

#[test]
fn hf_missing_wrong_shape_wrong_dtype() {
    let st_path = |d: &tempfile::TempDir| d.path().join("model.safetensors");
    // Missing tensor.
    let d = hf_dir(Arch::Qwen3);
    rewrite_safetensors(d.path(), |ts| ts.retain(|t| t.0 != "model.layers.1.self_attn.k_norm.weight"));
    let e = load_err(d.path(), F32);
    assert!(
        matches!(e, Error::MissingTensor { ref name, .. } if name == "model.layers.1.self_attn.k_norm.weight"),
        "{e}"
    );
    err_mentions(&e, &path_str(&st_path(&d)));
    // Untied model without lm_head.
    let d = hf_dir(Arch::Llama);
    rewrite_safetensors(d.path(), |ts| ts.retain(|t| t.0 != "lm_head.weight"));
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::MissingTensor { ref name, .. } if name == "lm_head.weight"), "{e}");
    // Wrong shape.
    let d = hf_dir(Arch::Mistral);
    rewrite_safetensors(d.path(), |ts| {
        for t in ts.iter_mut() {
            if t.0 == "model.norm.weight" {
                t.2 = vec![32];
                t.3.truncate(32 * 4);
            }
        }
    });
    let e = load_err(d.path(), F32);
    assert!(
        matches!(e, Error::BadShape { ref name, ref got, .. } if name == "model.norm.weight" && got == &[32]),
        "{e}"
    );
    err_mentions(&e, "model.norm.weight");
    // Transposed projection.
    let d = hf_dir(Arch::Qwen2);
    rewrite_safetensors(d.path(), |ts| {
        for t in ts.iter_mut() {
            if t.0 == "model.layers.0.mlp.down_proj.weight" {
                t.2.reverse();
            }
        }
    });
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::BadShape { ref name, .. } if name == "model.layers.0.mlp.down_proj.weight"), "{e}");
    // Wrong dtypes: I32 (same byte size) and U8.
    for (dt, width) in [(StDtype::I32, 4), (StDtype::U8, 1), (StDtype::F64, 8)] {
        let d = hf_dir(Arch::Llama);
        rewrite_safetensors(d.path(), |ts| {
            for t in ts.iter_mut() {
                if t.0 == "model.layers.0.input_layernorm.weight" {
                    t.1 = dt;
                    t.3 = vec![1u8; 64 * width];
                }
            }
        });
        let e = load_err(d.path(), F32);
        assert!(
            matches!(e, Error::BadDtype { ref name, ref got, .. } if name == "model.layers.0.input_layernorm.weight" && got == &format!("{dt:?}")),
            "{e}"
        );
    }
}

#[test]
fn hf_bad_config_and_shards() {
    // Unknown architecture.
    let d = hf_dir(Arch::Llama);
    let cfg_path = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, text.replace("\"llama\"", "\"gpt2\"")).unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::UnknownArchitecture(ref a) if a == "gpt2"), "{e}");
    // Broken JSON and a missing key name config.json.
    std::fs::write(&cfg_path, "{\"model_type\": \"llama\",").unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::BadConfig(_)), "{e}");
    err_mentions(&e, &path_str(&cfg_path));
    std::fs::write(&cfg_path, text.replace("\"num_hidden_layers\"", "\"n_layers\"")).unwrap();
    let e = load_err(d.path(), F32);
    err_mentions(&e, "num_hidden_layers");
    err_mentions(&e, &path_str(&cfg_path));
    // Config says more layers than the file has.
    std::fs::write(&cfg_path, text.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3")).unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::MissingTensor { ref name, .. } if name.starts_with("model.layers.2.")), "{e}");

    // Sharded: a shard the index names is missing; the index lacks a tensor; a shard name escapes.
    let w = random_weights(&random_config(Arch::Qwen2, true), DType::F32, 6).unwrap();
    let d = tmp();
    write_hf_folder_sharded(&w, d.path(), DType::F16, Some(20_000)).unwrap();
    let index_path = d.path().join("model.safetensors.index.json");
    let index = std::fs::read_to_string(&index_path).unwrap();
    let shard2 = d.path().join("model-00002-of-").to_string_lossy().into_owned();
    let shard2 = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().starts_with(&shard2))
        .unwrap();
    let moved = d.path().join("moved");
    std::fs::rename(&shard2, &moved).unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::Io { ref path, .. } if path == &shard2), "{e}");
    std::fs::rename(&moved, &shard2).unwrap();
    assert!(load_model(d.path(), F32).is_ok());
    let v: serde_json::Value = serde_json::from_str(&index).unwrap();
    let mut v2 = v.clone();
    v2["weight_map"].as_object_mut().unwrap().remove("model.norm.weight");
    std::fs::write(&index_path, v2.to_string()).unwrap();
    let e = load_err(d.path(), F32);
    assert!(
        matches!(e, Error::MissingTensor { ref name, ref path } if name == "model.norm.weight" && path == &index_path),
        "{e}"
    );
    let mut v3 = v.clone();
    v3["weight_map"]["model.norm.weight"] = "../../etc/passwd".into();
    std::fs::write(&index_path, v3.to_string()).unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    err_mentions(&e, &path_str(&index_path));
    std::fs::write(&index_path, "not json").unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let d = hf_dir(Arch::Qwen2);
    let st = d.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut cuts = vec![0, 1, 7, 8, 9, 100, header, header + 7, header + 8, header + 9, bytes.len() - 1];
    cuts.extend((0..bytes.len()).step_by(4099));
    for cut in cuts {
        std::fs::write(&st, &bytes[..cut]).unwrap();
        let e = load_err(d.path(), F32);
        assert!(matches!(e, Error::Corrupt { .. }), "cut at {cut}: {e}");
        err_mentions(&e, &path_str(&st));
    }
    // Header length past the end of the file (and absurdly large).
    for n in [bytes.len() as u64, 1 << 40, u64::MAX] {
        std::fs::write(&st, patch(&bytes, 0, &n.to_le_bytes())).unwrap();
        let t = Instant::now();
        let e = load_err(d.path(), F32);
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        err_mentions(&e, &path_str(&st));
    }
    // A data offset past the end inside the JSON header.
    let text = String::from_utf8_lossy(&bytes[8..8 + header]).into_owned();
    let i = text.find("\"data_offsets\":[").unwrap() + "\"data_offsets\":[".len();
    let mut b = bytes.clone();
    b[8 + i] = b'9';
    std::fs::write(&st, &b).unwrap();
    let e = load_err(d.path(), F32);
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The real default model, when it has been fetched
// ---------------------------------------------------------------------------------------------

fn default_model() -> Option<PathBuf> {
    let p = dirs_home()?.join(".cache/ferrum/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.is_file().then_some(p)
}

fn dirs_home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

#[test]
fn smollm2_q4_1_gguf_if_present() {
    let Some(path) = default_model() else {
        eprintln!("skipping: ~/.cache/ferrum/SmolLM2-135M-Instruct.Q4_1.gguf is not present");
        return;
    };
    let LoadedModel { weights: w, source } = load_model(&path, WeightFormat::Quantized).unwrap();
    let c = &w.config;
    let want = ferrum_runner::synthetic::named_config("smollm2-135m").unwrap();
    assert_eq!(
        (c.arch, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size),
        (Arch::Llama, 576, 1536, 30, 9, 3, 49152)
    );
    assert!(c.tie_word_embeddings && !c.attention_bias && c.rope_scaling.is_none());
    assert_eq!((c.head_dim, c.rope_theta, c.rms_norm_eps), (want.head_dim, want.rope_theta, want.rms_norm_eps));
    assert!(matches!(&w.layers[0].q, Linear::Quantized(q) if q.dtype() == GgmlDType::Q4_1));
    assert!(matches!(&w.lm_head, Linear::Quantized(_)));
    assert_eq!(w.embed.dims(), &[49152, 576]);
    assert!(source.gguf_metadata().unwrap().contains_key("tokenizer.ggml.tokens"));
    eprintln!("loaded {}: {c:?}", path.display());
    // Un-permutation check on real data: quantized row reordering == dense un-permute.
    let f = GgufFile::open(&path).unwrap();
    let stored = f.tensor("blk.0.attn_k.weight").unwrap().dequantize(&Device::Cpu).unwrap();
    let Linear::Quantized(k) = &w.layers[0].k else { unreachable!() };
    assert_eq!(max_diff(&k.dequantize(&Device::Cpu).unwrap(), &hf_reverse_permute(&stored, 3)), 0.0);
    // The config agrees with the HF config of the same model.
    assert_eq!(
        ModelConfig { eos_token_ids: want.eos_token_ids.clone(), bos_token_id: want.bos_token_id, ..c.clone() },
        want
    );
    eprintln!("bos {:?} eos {:?}", c.bos_token_id, c.eos_token_ids);
}
