//! The tensor-parallel sharding pass: one [`ModelWeights`] in, one per rank out.
//!
//! It is separate from the model code (as in gpt-fast's `tp.py`): a shard is an ordinary,
//! smaller model whose forward pass sums two partial results per layer over the ranks.
//!
//! - **Attention** is split by KV group: each rank takes whole KV heads and the query heads that
//!   attend to them (rows of q/k/v and their biases). When `tp` does not divide the KV heads,
//!   ranks get ⌈KV/tp⌉ or ⌊KV/tp⌋ groups, the larger ones first (SmolLM2's 3 KV heads over TP2
//!   give ranks 2 and 1 groups). The output projection `o` is split by the matching columns;
//!   its partial products are summed over ranks (reduction 1).
//! - **MLP**: gate/up split by rows of the intermediate dimension, down by the same columns;
//!   partial products summed over ranks (reduction 2). Split points are aligned to the
//!   quantization block where possible so quantized weights stay quantized.
//! - Embeddings, norms and the LM head are replicated.
//!
//! Quantized (GGUF) weights are sliced by moving whole blocks: rows are independent; a column
//! range is kept quantized when it starts and ends on a block boundary, and is dequantized to
//! f32 otherwise.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::weights::{LayerWeights, Linear, ModelWeights};

/// How the heads and the MLP landed on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSplit {
    /// KV heads `kv.start..kv.end`.
    pub kv: Range<usize>,
    /// Query heads (the KV heads' groups).
    pub q: Range<usize>,
    /// Intermediate (MLP) columns.
    pub ffn: Range<usize>,
}

/// The split of a model over `tp` ranks, checked.
pub fn plan(cfg: &crate::config::ModelConfig, tp: usize, ffn_align: usize) -> Result<Vec<RankSplit>> {
    if tp == 0 {
        return Err(Error::Tp("--tp must be at least 1".into()));
    }
    if tp > cfg.num_kv_heads {
        return Err(Error::Tp(format!(
            "--tp {tp} is larger than the model's {} KV heads: each rank needs at least one whole KV head",
            cfg.num_kv_heads
        )));
    }
    let g = cfg.group_size();
    let f = cfg.intermediate_size;
    let align = if ffn_align > 0 && f % ffn_align == 0 && f / ffn_align >= tp { ffn_align } else { 1 };
    let units = f / align;
    let mut out = Vec::with_capacity(tp);
    let (mut kv0, mut f0) = (0, 0);
    for r in 0..tp {
        let nkv = cfg.num_kv_heads / tp + usize::from(r < cfg.num_kv_heads % tp);
        let nf = (units / tp + usize::from(r < units % tp)) * align;
        out.push(RankSplit { kv: kv0..kv0 + nkv, q: kv0 * g..(kv0 + nkv) * g, ffn: f0..f0 + nf });
        kv0 += nkv;
        f0 += nf;
    }
    Ok(out)
}

/// A one-line description of the split, for the user.
pub fn describe(plan: &[RankSplit]) -> String {
    plan.iter()
        .enumerate()
        .map(|(r, s)| format!("rank {r}: {} KV heads, {} q heads, {} MLP cols", s.kv.len(), s.q.len(), s.ffn.len()))
        .collect::<Vec<_>>()
        .join("; ")
}

fn rows_dense(t: &Tensor, r: Range<usize>) -> Result<Tensor> {
    Ok(t.narrow(0, r.start, r.len())?.contiguous()?)
}

/// Rows `r` of a linear weight `[out, in]`.
fn rows(l: &Linear, r: Range<usize>) -> Result<Linear> {
    match l {
        Linear::Dense(t) => Ok(Linear::Dense(rows_dense(t, r)?)),
        Linear::Quantized(q) => {
            let (n, k) = q.shape().dims2()?;
            let data = q.data()?;
            let row_bytes = data.len() / n;
            let bytes = &data[r.start * row_bytes..r.end * row_bytes];
            let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, q.dtype())?;
            Ok(Linear::Quantized(Arc::new(QTensor::new(storage, (r.len(), k))?)))
        }
    }
}

/// Columns `c` of a linear weight `[out, in]`.
fn cols(l: &Linear, c: Range<usize>) -> Result<Linear> {
    match l {
        Linear::Dense(t) => Ok(Linear::Dense(t.narrow(1, c.start, c.len())?.contiguous()?)),
        Linear::Quantized(q) => {
            let bs = q.dtype().block_size();
            let (n, k) = q.shape().dims2()?;
            if c.start % bs != 0 || c.end % bs != 0 || k % bs != 0 {
                let dense = q.dequantize(&Device::Cpu)?;
                return Ok(Linear::Dense(dense.narrow(1, c.start, c.len())?.contiguous()?));
            }
            let data = q.data()?;
            let row_bytes = data.len() / n;
            let block_bytes = row_bytes / (k / bs);
            let (b0, b1) = (c.start / bs * block_bytes, c.end / bs * block_bytes);
            let mut bytes = Vec::with_capacity(n * (b1 - b0));
            for row in data.chunks_exact(row_bytes) {
                bytes.extend_from_slice(&row[b0..b1]);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, q.dtype())?;
            Ok(Linear::Quantized(Arc::new(QTensor::new(storage, (n, c.len()))?)))
        }
    }
}

/// The block size a model's MLP split should respect (1 for dense weights).
fn ffn_alignment(w: &ModelWeights) -> usize {
    w.layers
        .iter()
        .filter_map(|l| match &l.down {
            Linear::Quantized(q) => Some(q.dtype().block_size()),
            Linear::Dense(_) => None,
        })
        .max()
        .unwrap_or(1)
}

/// Splits `w` over `tp` ranks; returns the shards and the plan.
pub fn shard(w: &ModelWeights, tp: usize) -> Result<(Vec<ModelWeights>, Vec<RankSplit>)> {
    let cfg = &w.config;
    let p = plan(cfg, tp, ffn_alignment(w))?;
    let hd = cfg.head_dim;
    let heads = |r: &Range<usize>| r.start * hd..r.end * hd;
    let bias = |b: &Option<Tensor>, r: Range<usize>| b.as_ref().map(|t| rows_dense(t, r)).transpose();
    let mut shards = Vec::with_capacity(tp);
    for s in &p {
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(LayerWeights {
                    attn_norm: l.attn_norm.clone(),
                    q: rows(&l.q, heads(&s.q))?,
                    k: rows(&l.k, heads(&s.kv))?,
                    v: rows(&l.v, heads(&s.kv))?,
                    o: cols(&l.o, heads(&s.q))?,
                    q_bias: bias(&l.q_bias, heads(&s.q))?,
                    k_bias: bias(&l.k_bias, heads(&s.kv))?,
                    v_bias: bias(&l.v_bias, heads(&s.kv))?,
                    q_norm: l.q_norm.clone(),
                    k_norm: l.k_norm.clone(),
                    mlp_norm: l.mlp_norm.clone(),
                    gate: rows(&l.gate, s.ffn.clone())?,
                    up: rows(&l.up, s.ffn.clone())?,
                    down: cols(&l.down, s.ffn.clone())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        shards.push(ModelWeights {
            config: cfg.clone(),
            dtype: w.dtype,
            embed: w.embed.clone(),
            layers,
            final_norm: w.final_norm.clone(),
            lm_head: w.lm_head.clone(),
        });
    }
    Ok((shards, p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn uneven_kv_split_follows_groups() {
        let mut cfg = crate::synthetic::named_config("smollm2-135m").unwrap();
        let p = plan(&cfg, 2, 256).unwrap();
        assert_eq!(p[0].kv, 0..2);
        assert_eq!(p[1].kv, 2..3);
        assert_eq!(p[0].q, 0..6);
        assert_eq!(p[1].q, 6..9);
        assert_eq!(p[0].ffn.len() + p[1].ffn.len(), 1536);
        assert_eq!(p[0].ffn.len() % 256, 0);
        let p3 = plan(&cfg, 3, 32).unwrap();
        assert!(p3.iter().all(|s| s.kv.len() == 1 && s.q.len() == 3));
        assert!(plan(&cfg, 4, 1).unwrap_err().to_string().contains("KV heads"));
        assert!(plan(&cfg, 0, 1).is_err());
        cfg.intermediate_size = 1000; // not a multiple of the alignment: falls back to 1
        let p = plan(&cfg, 3, 256).unwrap();
        assert_eq!(p.iter().map(|s| s.ffn.len()).sum::<usize>(), 1000);
    }

    #[test]
    fn quantized_row_and_column_slices_match_dense_slices() {
        use candle_core::quantized::GgmlDType;
        let t = Tensor::randn(0f32, 1.0, (8, 128), &Device::Cpu).unwrap();
        let q = Linear::Quantized(Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0).unwrap()));
        let dq = q.to_dense(DType::F32).unwrap();
        let r = rows(&q, 2..5).unwrap();
        assert!(matches!(r, Linear::Quantized(_)));
        let diff = (r.to_dense(DType::F32).unwrap() - dq.narrow(0, 2, 3).unwrap()).unwrap().abs().unwrap();
        assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        let c = cols(&q, 32..96).unwrap();
        assert!(matches!(c, Linear::Quantized(_)));
        let diff = (c.to_dense(DType::F32).unwrap() - dq.narrow(1, 32, 64).unwrap()).unwrap().abs().unwrap();
        assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        // Unaligned columns fall back to dense, with the same values.
        let c = cols(&q, 10..50).unwrap();
        assert!(matches!(c, Linear::Dense(_)));
        let diff = (c.to_dense(DType::F32).unwrap() - dq.narrow(1, 10, 40).unwrap()).unwrap().abs().unwrap();
        assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
