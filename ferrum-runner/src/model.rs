//! The CPU reference forward pass, on candle-core.
//!
//! This is ferrum's correctness oracle: every GPU result is checked against it. It is written
//! to be read, one layer at a time, with the shapes beside every reshape
//! (`T` = tokens in this call, `S` = tokens in the cache after it, `D` = hidden, `H`/`KV` =
//! this rank's query/KV heads, `G = H / KV`, `hd` = head dim).
//!
//! A [`CpuModel`] may hold a whole model or one tensor-parallel shard of it: the head counts
//! and MLP width are read from the weight shapes, and the two per-layer reduction points
//! (after the attention output projection and after the MLP down projection) call a
//! [`Reducer`], which is a no-op for a whole model.

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::cpu_quant::{CpuLinear, ProjGroup};
use crate::error::{Error, Result};
use crate::weights::{LayerWeights, ModelWeights};

/// Where a tensor-parallel shard's partial sums are combined. A whole model needs none.
pub trait Reducer {
    /// Replaces `partial` (`[T, D]`, f32) by its sum over all ranks.
    fn all_reduce(&mut self, partial: Tensor) -> Result<Tensor>;
}

/// The reducer of a model that is not sharded.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoReduce;

impl Reducer for NoReduce {
    fn all_reduce(&mut self, partial: Tensor) -> Result<Tensor> {
        Ok(partial)
    }
}

/// One layer's weights, ready for the CPU (matmul operators built once).
#[derive(Debug)]
struct CpuLayer {
    attn_norm: Tensor,
    /// q, k, v (one stacked matrix when they are Q4_1).
    qkv: ProjGroup,
    o: CpuLinear,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp_norm: Tensor,
    /// gate, up (one stacked matrix when they are Q4_1).
    gate_up: ProjGroup,
    down: CpuLinear,
}

/// A Llama-family decoder (or one TP shard of it) on the CPU.
#[derive(Debug)]
pub struct CpuModel {
    config: ModelConfig,
    /// Activation dtype: f32, except for dense f16/bf16 weights.
    dtype: DType,
    /// This rank's query heads and KV heads.
    heads: usize,
    kv_heads: usize,
    embed: Tensor,
    layers: Vec<CpuLayer>,
    final_norm: Tensor,
    lm_head: CpuLinear,
    /// RoPE inverse frequencies, `[1, hd/2]` f32. The cos/sin tables are built per cache for
    /// its capacity: a table for the whole context could be far larger than anything used
    /// (2^24 positions of head_dim 1024 is 32 GiB).
    inv_freq: Tensor,
}

/// One sequence's KV cache: per layer `[KV, capacity, hd]` for keys and values, and the
/// `[capacity, hd/2]` RoPE tables of its positions.
#[derive(Debug)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    cos: Tensor,
    sin: Tensor,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Tokens already in the cache (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing has been prefilled yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most tokens this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets the cached tokens (the buffers are kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?)
}

fn linear(x: &Tensor, w: &CpuLinear, bias: Option<&Tensor>) -> Result<Tensor> {
    add_bias(w.forward(x)?, bias)
}

fn add_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

impl CpuModel {
    /// Builds the CPU model from loaded (or sharded) weights.
    pub fn new(w: &ModelWeights) -> Result<Self> {
        let cfg = w.config.clone();
        cfg.validate()?;
        let hd = cfg.head_dim;
        let first = w.layers.first().ok_or_else(|| Error::BadConfig("model has no layers".into()))?;
        let (q_rows, _) = first.q.dims();
        let (k_rows, _) = first.k.dims();
        if q_rows % hd != 0 || k_rows % hd != 0 || k_rows == 0 || (q_rows / hd) % (k_rows / hd) != 0 {
            return Err(Error::BadConfig(format!(
                "q/k projections of {q_rows}/{k_rows} rows do not hold whole heads of {hd}"
            )));
        }
        let (heads, kv_heads) = (q_rows / hd, k_rows / hd);
        // Dense f16/bf16 weights compute in that dtype; quantized and f32 weights in f32.
        let dtype = match w.dtype {
            DType::F16 | DType::BF16 => w.dtype,
            _ => DType::F32,
        };
        let layers = w.layers.iter().map(|l| Self::layer(l, dtype)).collect::<Result<Vec<_>>>()?;

        let inv_freq = Tensor::from_vec(cfg.rope_inv_freq(), (1, hd / 2), &Device::Cpu)?;
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?) };
        Ok(Self {
            dtype,
            heads,
            kv_heads,
            embed: to(w.embed.clone())?,
            layers,
            final_norm: to(w.final_norm.clone())?,
            lm_head: w.lm_head.cpu_linear()?,
            inv_freq,
            config: cfg,
        })
    }

    /// The RoPE cos and sin tables of positions `0..n`, `[n, hd/2]` in the activation dtype,
    /// computed in f32 exactly as HF does: freqs = pos ⊗ inv_freq. Each entry depends only on
    /// its position, so a table for `n` positions is the first `n` rows of a longer one.
    fn rope_tables(&self, n: usize) -> Result<(Tensor, Tensor)> {
        let n32 = u32::try_from(n).map_err(|_| Error::InvalidInput(format!("{n} positions do not fit a u32")))?;
        let pos = Tensor::arange(0u32, n32, &Device::Cpu)?.to_dtype(DType::F32)?.reshape((n, 1))?;
        let freqs = pos.broadcast_mul(&self.inv_freq)?; // [n, hd/2]
        Ok((freqs.cos()?.to_dtype(self.dtype)?, freqs.sin()?.to_dtype(self.dtype)?))
    }

    fn layer(l: &LayerWeights, dtype: DType) -> Result<CpuLayer> {
        let c = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?) };
        let co = |t: &Option<Tensor>| -> Result<Option<Tensor>> { t.as_ref().map(c).transpose() };
        Ok(CpuLayer {
            attn_norm: c(&l.attn_norm)?,
            qkv: ProjGroup::new(&[&l.q, &l.k, &l.v])?,
            o: l.o.cpu_linear()?,
            q_bias: co(&l.q_bias)?,
            k_bias: co(&l.k_bias)?,
            v_bias: co(&l.v_bias)?,
            q_norm: co(&l.q_norm)?,
            k_norm: co(&l.k_norm)?,
            mlp_norm: c(&l.mlp_norm)?,
            gate_up: ProjGroup::new(&[&l.gate, &l.up])?,
            down: l.down.cpu_linear()?,
        })
    }

    /// The model's configuration (global shape, not this shard's).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// This shard's (query heads, KV heads).
    pub fn local_heads(&self) -> (usize, usize) {
        (self.heads, self.kv_heads)
    }

    /// A KV cache for up to `capacity` tokens (at most the model's context length).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let max = self.config.max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(Error::InvalidInput(format!(
                "KV capacity {capacity} must be in 1..={max} (the model's context length)"
            )));
        }
        let shape = (self.kv_heads, capacity, self.config.head_dim);
        let mk = || Tensor::zeros(shape, self.dtype, &Device::Cpu);
        let n = self.layers.len();
        let (cos, sin) = self.rope_tables(capacity)?;
        Ok(KvCache {
            k: (0..n).map(|_| mk()).collect::<candle_core::Result<_>>()?,
            v: (0..n).map(|_| mk()).collect::<candle_core::Result<_>>()?,
            cos,
            sin,
            len: 0,
            capacity,
        })
    }

    /// Runs the whole prompt at once, filling the cache; returns the last position's logits.
    pub fn prefill(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward_with(cache, tokens, &mut NoReduce)
    }

    /// Runs one token at position `cache.len()`; returns its logits.
    pub fn decode_step(&self, cache: &mut KvCache, token: u32) -> Result<Vec<f32>> {
        self.forward_with(cache, &[token], &mut NoReduce)
    }

    /// Runs `tokens` at positions `cache.len()..`, reducing partial sums through `reducer`;
    /// returns the logits of the last token (`[V]`, f32). On error the cache is unchanged.
    pub fn forward_with(&self, cache: &mut KvCache, tokens: &[u32], reducer: &mut dyn Reducer) -> Result<Vec<f32>> {
        let (last, len) = self.forward_last(cache, tokens, reducer)?;
        let logits = self.lm_head.forward(&last)?; // [1, V]
        let logits = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        cache.len = len; // only once nothing more can fail
        Ok(logits)
    }

    /// Runs `tokens` at positions `cache.len()..` like [`forward_with`](Self::forward_with)
    /// without a reducer, and returns the last token's final RMSNorm output (`[D]`, f32): the
    /// LM head's input, for analyses of the head (such as [`crate::screen`]). On error the
    /// cache is unchanged.
    pub fn forward_normed(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        let (last, len) = self.forward_last(cache, tokens, &mut NoReduce)?;
        let x = last.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        cache.len = len;
        Ok(x)
    }

    fn check_input(&self, cache: &KvCache, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidInput("no tokens to run".into()));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            return Err(Error::TokenOutOfRange { token: t, vocab: self.config.vocab_size });
        }
        let shape = (self.kv_heads, cache.capacity, self.config.head_dim);
        if cache.k.len() != self.layers.len() || cache.k.first().is_some_and(|k| k.dims3().ok() != Some(shape)) {
            return Err(Error::InvalidInput("KV cache belongs to another model".into()));
        }
        let end = cache.len + tokens.len();
        if end > cache.capacity {
            return Err(Error::ContextOverflow { position: end - 1, capacity: cache.capacity });
        }
        Ok(())
    }

    /// The layers and the final RMSNorm: the last token's normed hidden state (`[1, D]`) and
    /// the cache's length after the tokens, which the caller sets once nothing more can fail
    /// (the tokens' K/V rows are written at positions the length does not yet cover).
    fn forward_last(&self, cache: &mut KvCache, tokens: &[u32], reducer: &mut dyn Reducer) -> Result<(Tensor, usize)> {
        self.check_input(cache, tokens)?;
        let cfg = &self.config;
        let (t, start) = (tokens.len(), cache.len);
        let (h, kv, hd) = (self.heads, self.kv_heads, cfg.head_dim);
        let g = h / kv;
        let s = start + t;
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [T, D]
        let cos = cache.cos.narrow(0, start, t)?; // [T, hd/2]
        let sin = cache.sin.narrow(0, start, t)?;
        let scale = 1.0 / (hd as f64).sqrt();
        // Causal mask for prefill: query (g, t) may see keys 0..=start+t. Rows are [G*T].
        let mask = if t > 1 {
            let m: Vec<f32> = (0..g * t)
                .flat_map(|row| {
                    let qpos = start + row % t;
                    (0..s).map(move |kpos| if kpos <= qpos { 0.0 } else { f32::NEG_INFINITY })
                })
                .collect();
            Some(Tensor::from_vec(m, (g * t, s), &Device::Cpu)?.to_dtype(self.dtype)?)
        } else {
            None
        };

        for (li, l) in self.layers.iter().enumerate() {
            // ---- attention ----
            let hn = rms_norm(&x, &l.attn_norm, cfg.rms_norm_eps)?;
            let [q, k, v]: [Tensor; 3] = l
                .qkv
                .forward(&hn)?
                .try_into()
                .map_err(|_| Error::BadConfig("q/k/v projection group must have 3 parts".into()))?;
            let q = add_bias(q, l.q_bias.as_ref())?; // [T, H*hd]
            let k = add_bias(k, l.k_bias.as_ref())?; // [T, KV*hd]
            let v = add_bias(v, l.v_bias.as_ref())?; // [T, KV*hd]
            let mut q = q.reshape((t, h, hd))?.transpose(0, 1)?.contiguous()?; // [H, T, hd]
            let mut k = k.reshape((t, kv, hd))?.transpose(0, 1)?.contiguous()?; // [KV, T, hd]
            let v = v.reshape((t, kv, hd))?.transpose(0, 1)?.contiguous()?; // [KV, T, hd]
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                q = rms_norm(&q, qn, cfg.rms_norm_eps)?; // per head, over hd
                k = rms_norm(&k, kn, cfg.rms_norm_eps)?;
            }
            let q = candle_nn::rotary_emb::rope(&q.unsqueeze(0)?, &cos, &sin)?.squeeze(0)?; // [H, T, hd]
            let k = candle_nn::rotary_emb::rope(&k.unsqueeze(0)?, &cos, &sin)?.squeeze(0)?; // [KV, T, hd]
            cache.k[li].slice_set(&k, 1, start)?;
            cache.v[li].slice_set(&v, 1, start)?;
            let keys = cache.k[li].narrow(1, 0, s)?; // [KV, S, hd]
            let vals = cache.v[li].narrow(1, 0, s)?; // [KV, S, hd]
                                                     // Heads h = kv*G + g share KV head kv: [H, T, hd] -> [KV, G*T, hd].
            let q = q.reshape((kv, g * t, hd))?;
            let att = (q.matmul(&keys.t()?)? * scale)?; // [KV, G*T, S]
            let att = match &mask {
                Some(m) => att.broadcast_add(m)?,
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let o = att.matmul(&vals)?; // [KV, G*T, hd]
            let o = o.reshape((h, t, hd))?.transpose(0, 1)?.reshape((t, h * hd))?; // [T, H*hd]
            let o = reducer.all_reduce(linear(&o, &l.o, None)?)?; // [T, D]
            x = (x + o)?;

            // ---- MLP ----
            let hn = rms_norm(&x, &l.mlp_norm, cfg.rms_norm_eps)?;
            let [gate, up]: [Tensor; 2] = l
                .gate_up
                .forward(&hn)?
                .try_into()
                .map_err(|_| Error::BadConfig("gate/up projection group must have 2 parts".into()))?;
            let gate = candle_nn::ops::silu(&gate)?; // [T, F]
            let down = reducer.all_reduce(linear(&(gate * up)?, &l.down, None)?)?; // [T, D]
            x = (x + down)?;
        }
        let last = x.narrow(0, t - 1, 1)?; // [1, D]
        Ok((rms_norm(&last, &self.final_norm, cfg.rms_norm_eps)?, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;
    use crate::synthetic::{random_config, random_weights};

    #[test]
    fn rope_tables_are_sized_by_the_cache_not_the_context() {
        // The longest context and widest heads `validate` allows: tables for the whole
        // context would be [2^24, 512] f32, 32 GiB each. Only the cache's rows are built.
        let mut cfg = random_config(Arch::Qwen2, false);
        (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (1, 1, 1024);
        cfg.max_position_embeddings = crate::config::limits::MAX_CONTEXT;
        let w = random_weights(&cfg, DType::F32, 1).unwrap();
        let m = CpuModel::new(&w).unwrap();
        let mut cache = m.new_cache(4).unwrap();
        assert_eq!(cache.cos.dims(), &[4, 512]);
        let logits = m.prefill(&mut cache, &[1, 2, 3]).unwrap();
        assert_eq!(logits.len(), cfg.vocab_size);
        assert!(logits.iter().all(|x| x.is_finite()));
        m.decode_step(&mut cache, 4).unwrap();
        assert!(matches!(m.decode_step(&mut cache, 5), Err(Error::ContextOverflow { position: 4, capacity: 4 })));
    }

    #[test]
    fn cache_capacity_does_not_change_results() {
        let cfg = random_config(Arch::Llama, false);
        let w = random_weights(&cfg, DType::F32, 2).unwrap();
        let m = CpuModel::new(&w).unwrap();
        // A short table is exactly the first rows of a long one.
        let (short_cos, short_sin) = m.rope_tables(5).unwrap();
        let (long_cos, long_sin) = m.rope_tables(cfg.max_position_embeddings).unwrap();
        let rows = |t: &Tensor| t.narrow(0, 0, 5).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(short_cos.to_vec2::<f32>().unwrap(), rows(&long_cos));
        assert_eq!(short_sin.to_vec2::<f32>().unwrap(), rows(&long_sin));
        let run = |capacity: usize| {
            let mut cache = m.new_cache(capacity).unwrap();
            let mut logits = m.prefill(&mut cache, &[3, 4, 5]).unwrap();
            for t in [6, 7] {
                logits = m.decode_step(&mut cache, t).unwrap();
            }
            logits
        };
        let (short, long) = (run(5), run(cfg.max_position_embeddings));
        let diff = short.iter().zip(&long).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-5, "logits differ by {diff}");
    }
}
