//! The in-memory form of a model's weights, independent of the file format they came from.
//!
//! Loaders (`gguf`, `hf`) map their own tensor names once, through one table per format,
//! onto [`WeightName`], check every shape against [`ModelConfig`], and return
//! [`ModelWeights`]. Backends (the CPU reference in `model`, the CUDA runner) read only this.
//!
//! Conventions, shared by every backend:
//! - Linear weights are stored as HF does: `[out_features, in_features]`, `y = x · Wᵀ`.
//! - RoPE is the half-split form of HF Llama. GGUF files of arch `llama` store q/k rows
//!   permuted for llama.cpp's interleaved RoPE; the GGUF loader undoes that permutation, so
//!   every backend sees HF layout.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Tensor};

use crate::config::ModelConfig;
use crate::cpu_quant::{CpuLinear, Q41Matrix};
use crate::error::Result;

/// How the weights of linear layers are kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Keep GGUF quantized blocks as they are (candle's quantized matmul). Only valid for GGUF
    /// files; dense tensors (norms, biases) are f32.
    Quantized,
    /// Dequantize / convert every tensor to this dtype (F32, F16 or BF16).
    Dense(DType),
}

/// A linear layer's weight matrix, `[out, in]`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// A dense matrix in the model's compute dtype.
    Dense(Tensor),
    /// GGUF quantized blocks, multiplied by candle's quantized kernels.
    Quantized(Arc<QTensor>),
}

impl Linear {
    /// `[out, in]` shape.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Linear::Dense(t) => {
                let d = t.dims();
                (d[0], d[1])
            }
            Linear::Quantized(q) => {
                let d = q.shape().dims();
                (d[0], d[1])
            }
        }
    }

    /// The weight as a dense tensor of `dtype` (dequantizing if needed).
    pub fn to_dense(&self, dtype: DType) -> Result<Tensor> {
        Ok(match self {
            Linear::Dense(t) => t.to_dtype(dtype)?,
            Linear::Quantized(q) => q.dequantize(&candle_core::Device::Cpu)?.to_dtype(dtype)?,
        })
    }

    /// A matmul operator over this weight for the CPU path.
    ///
    /// candle has SIMD dot products for Q4_0, Q8_0 and the K-quants, but only scalar code for
    /// Q4_1, Q5_0 and Q5_1 (the default model is Q4_1: its 576-wide rows rule out K-quants).
    /// Those are re-quantized to Q8_0 here: 1.7x the bytes of Q4_1 but several times faster
    /// on AVX2, and Q8_0's rounding (1/254 of each 32-block's range) is far below Q4_1's.
    /// The CPU model itself runs Q4_1 through ferrum's own kernel instead: see
    /// [`Linear::cpu_linear`].
    pub fn qmatmul(&self) -> Result<QMatMul> {
        use candle_core::quantized::GgmlDType;
        Ok(match self {
            Linear::Dense(t) => QMatMul::Tensor(t.clone()),
            Linear::Quantized(q) if matches!(q.dtype(), GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1) => {
                let dense = q.dequantize(&candle_core::Device::Cpu)?;
                QMatMul::from_arc(Arc::new(QTensor::quantize(&dense, GgmlDType::Q8_0)?))?
            }
            Linear::Quantized(q) => QMatMul::from_arc(q.clone())?,
        })
    }

    /// The matmul operator of the CPU forward pass: Q4_1 blocks stay as they are and run on
    /// [`crate::cpu_quant`]'s kernels; everything else goes through [`Linear::qmatmul`].
    pub fn cpu_linear(&self) -> Result<CpuLinear> {
        use candle_core::quantized::GgmlDType;
        Ok(match self {
            Linear::Quantized(q) if q.dtype() == GgmlDType::Q4_1 => CpuLinear::Q4_1(Q41Matrix::from_qtensor(q)?),
            _ => CpuLinear::Candle(self.qmatmul()?),
        })
    }
}

/// The canonical name of one weight, independent of the file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightName {
    Embed,
    FinalNorm,
    LmHead,
    Layer(usize, LayerWeight),
}

/// The weights of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerWeight {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    /// Output projection bias (Llama/Qwen3 with `attention_bias`; not held by
    /// [`LayerWeights`] yet, so loaders reject such models).
    OBias,
    QNorm,
    KNorm,
    MlpNorm,
    Gate,
    Up,
    Down,
}

/// One decoder layer. Shapes with `D = hidden`, `F = intermediate`, `H`/`KV` heads, `hd` head dim.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[D]`
    pub attn_norm: Tensor,
    /// `[H*hd, D]`
    pub q: Linear,
    /// `[KV*hd, D]`
    pub k: Linear,
    /// `[KV*hd, D]`
    pub v: Linear,
    /// `[D, H*hd]`
    pub o: Linear,
    /// `[H*hd]`, `[KV*hd]`, `[KV*hd]` (Qwen2 only)
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    /// `[hd]` each (Qwen3 only)
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// `[D]`
    pub mlp_norm: Tensor,
    /// `[F, D]`
    pub gate: Linear,
    /// `[F, D]`
    pub up: Linear,
    /// `[D, F]`
    pub down: Linear,
}

/// A whole model's weights, on the CPU.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: ModelConfig,
    /// The dtype of dense tensors (norms, biases, embeddings, dense linears).
    pub dtype: DType,
    /// `[V, D]`, always dense (GGUF embeddings are dequantized at load).
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    /// `[D]`
    pub final_norm: Tensor,
    /// `[V, D]`; for tied embeddings this is the embedding matrix again.
    pub lm_head: Linear,
}
