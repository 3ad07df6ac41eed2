//! ferrum's own CPU matmul for Q4_1 weights.
//!
//! candle 0.11 has only a scalar dot product for Q4_1, so the CPU path used to re-quantize
//! Q4_1 to Q8_0 (1.7x the bytes). This module keeps the GGUF Q4_1 blocks as they are and
//! multiplies them with activations quantized per 32-block to a Q8_1-like format, with the math
//! of ggml's `ggml_vec_dot_q4_1_q8_1`:
//!
//! ```text
//! w_j = d_w·q_w,j + m_w          (q_w in 0..16, d_w / m_w f16)
//! x_j ≈ d_x·q_x,j                (q_x in -127..=127, d_x f32), s_x = d_x·Σ_j q_x,j
//! Σ_j w_j·x_j ≈ d_w·d_x·Σ_j q_w,j·q_x,j + m_w·s_x
//! ```
//!
//! - **Kernels**: an AVX2+FMA+F16C kernel (`_mm256_maddubs_epi16` on the unpacked nibbles, as in
//!   ggml's x86 code) chosen at run time with `is_x86_feature_detected!`, and a portable scalar
//!   fallback. Both process up to [`ROW_TILE`] weight rows per pass, sharing the loads of the
//!   quantized activations.
//! - **Threads**: output row tiles are split over candle's persistent "barrier pool" (the same
//!   threads candle's own quantized kernels use, so the two never oversubscribe the cores). Its
//!   workers spin briefly before parking, so a fork/join costs ~1 µs in a decode step.
//! - **Prefill** (`m > 1`): each row tile loops over all activation rows while its weights sit in
//!   L1.

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Storage, Tensor};

use crate::error::{Error, Result};

/// Elements per quantization block.
pub const QK: usize = 32;
/// Bytes of one GGUF Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 20;
/// Weight rows per kernel pass.
pub const ROW_TILE: usize = 4;
/// Below this many block-dot products (per call) the work runs on the calling thread only.
const PAR_MIN_BLOCK_DOTS: usize = 2048;

/// One 32-element block of quantized activations (ggml's `block_q8_1`, with f32 `d` and `s`).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale: `x_j ≈ d·qs[j]`.
    pub d: f32,
    /// `d·Σ qs`, which carries the Q4_1 offset `m` in one multiply.
    pub s: f32,
    /// Quantized values in -127..=127.
    pub qs: [i8; QK],
}

impl Default for BlockQ8_1 {
    fn default() -> Self {
        Self { d: 0.0, s: 0.0, qs: [0; QK] }
    }
}

/// Quantizes `x` (a multiple of [`QK`] long) into `out` (`x.len() / QK` blocks), as ggml's
/// `quantize_row_q8_1_ref` (round to nearest, `d = max|x| / 127`).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) -> Result<()> {
    if x.len() % QK != 0 || out.len() != x.len() / QK {
        return Err(Error::InvalidInput(format!(
            "quantize_row_q8_1: {} values into {} blocks of {QK}",
            x.len(),
            out.len()
        )));
    }
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            // |v·id| <= 127 (up to rounding), so the cast cannot wrap.
            let r = (v * id).round() as i8;
            *q = r;
            sum += i32::from(r);
        }
        ob.d = d;
        ob.s = d * sum as f32;
    }
    Ok(())
}

/// Which dot-product kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64 only).
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if Kernel::Avx2.supported() {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Whether this CPU can run `self`.
    pub fn supported(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// A Q4_1 weight matrix `[rows, cols]` in GGUF block layout (row-major, `cols / 32` blocks of
/// [`Q4_1_BLOCK_BYTES`] per row), multiplied as `y = x · Wᵀ`.
#[derive(Clone)]
pub struct Q41Matrix {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for Q41Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q41Matrix").field("rows", &self.rows).field("cols", &self.cols).finish_non_exhaustive()
    }
}

impl Q41Matrix {
    /// Wraps raw Q4_1 block bytes of a `[rows, cols]` matrix.
    pub fn from_bytes(rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if cols == 0 || cols % QK != 0 || data.len() != rows * (cols / QK) * Q4_1_BLOCK_BYTES {
            return Err(Error::InvalidInput(format!(
                "Q4_1 matrix [{rows}, {cols}] needs cols a positive multiple of {QK} and {} bytes, got {}",
                rows * (cols / QK) * Q4_1_BLOCK_BYTES,
                data.len()
            )));
        }
        Ok(Self { rows, cols, data })
    }

    /// Copies the blocks of a 2-D Q4_1 [`QTensor`].
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        if q.dtype() != GgmlDType::Q4_1 {
            return Err(Error::InvalidInput(format!("expected a Q4_1 tensor, got {:?}", q.dtype())));
        }
        let (rows, cols) = q.shape().dims2()?;
        Self::from_bytes(rows, cols, q.data()?.into_owned())
    }

    /// Stacks matrices of equal width by rows (e.g. q/k/v into one projection).
    pub fn concat_rows(parts: &[&Q41Matrix]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).ok_or_else(|| Error::InvalidInput("no matrices to stack".into()))?;
        if parts.iter().any(|p| p.cols != cols) {
            return Err(Error::InvalidInput("stacked Q4_1 matrices must have equal widths".into()));
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Self::from_bytes(parts.iter().map(|p| p.rows).sum(), cols, data)
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data (read once per matmul).
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        self.cols / QK * Q4_1_BLOCK_BYTES
    }

    /// `out[i·rows + r] = Σ_j W[r, j]·x[i·cols + j]` for `m` rows of `x`, with `kernel`,
    /// spread over candle's CPU worker threads.
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.rows, self.cols);
        if x.len() != m * k || out.len() != m * n {
            return Err(Error::InvalidInput(format!(
                "Q4_1 matmul: [{m}, {k}] x [{n}, {k}]ᵀ with {} inputs and {} outputs",
                x.len(),
                out.len()
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let nb = k / QK;
        let mut xq = vec![BlockQ8_1::default(); m * nb];
        for (xr, qr) in x.chunks_exact(k).zip(xq.chunks_exact_mut(nb)) {
            quantize_row_q8_1(xr, qr)?;
        }
        self.matmul_q8_1(kernel, &xq, m, out)
    }

    /// [`Self::matmul_with`] with the fastest kernel of this CPU.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        self.matmul_with(Kernel::detect(), x, m, out)
    }

    /// The product with already quantized activations `xq` (`m` rows of `cols / 32` blocks).
    pub fn matmul_q8_1(&self, kernel: Kernel, xq: &[BlockQ8_1], m: usize, out: &mut [f32]) -> Result<()> {
        let (n, nb) = (self.rows, self.cols / QK);
        if xq.len() != m * nb || out.len() != m * n {
            return Err(Error::InvalidInput(format!(
                "Q4_1 matmul: {} activation blocks for {m} rows of {nb}, {} outputs for {m}x{n}",
                xq.len(),
                out.len()
            )));
        }
        if !kernel.supported() {
            return Err(Error::Unavailable("this Q4_1 kernel", format!("this CPU cannot run {kernel:?}")));
        }
        let n_tiles = n.div_ceil(ROW_TILE);
        let out_ptr = OutPtr(out.as_mut_ptr());
        let work = |tiles: Range<usize>| {
            for t in tiles {
                self.tile(kernel, t, xq, m, out_ptr);
            }
        };
        if n * m * nb < PAR_MIN_BLOCK_DOTS {
            work(0..n_tiles);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(n_tiles, work);
        }
        Ok(())
    }

    /// Rows `t·ROW_TILE..` of the output, for all `m` activation rows.
    ///
    /// Callers guarantee: `t < rows.div_ceil(ROW_TILE)`, `xq.len() == m·cols/32`, `out` points
    /// to `m·rows` writable floats of which no other thread touches this tile's rows, and
    /// `kernel.supported()` (checked in `matmul_q8_1`).
    fn tile(&self, kernel: Kernel, t: usize, xq: &[BlockQ8_1], m: usize, out: OutPtr) {
        let (n, nb, rb) = (self.rows, self.cols / QK, self.row_bytes());
        let r0 = t * ROW_TILE;
        let nr = ROW_TILE.min(n - r0);
        let w = &self.data[r0 * rb..(r0 + nr) * rb];
        for (i, xr) in xq.chunks_exact(nb).enumerate().take(m) {
            let mut res = [0f32; ROW_TILE];
            dot_rows(kernel, w, rb, nr, xr, &mut res);
            for (r, &v) in res.iter().enumerate().take(nr) {
                // SAFETY: i < m and r0 + r < n, so the index is below m·n, the length of the
                // output buffer `out` points into (checked in `matmul_q8_1`). Row tiles are
                // disjoint and each tile index is handed to exactly one worker by
                // `execute_chunked`, so no other thread reads or writes this element, and the
                // buffer outlives the (blocking) `execute_chunked` call.
                unsafe { out.0.add(i * n + r0 + r).write(v) };
            }
        }
    }
}

/// The output buffer, shared by the workers of one matmul; each writes only its own rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the pointer is only dereferenced in `Q41Matrix::tile`, on elements that belong to
// exactly one tile, hence one thread, while the owning `&mut [f32]` is borrowed for the call.
unsafe impl Send for OutPtr {}
// SAFETY: as above: concurrent users write disjoint elements.
unsafe impl Sync for OutPtr {}

/// `res[r] = row r of w · x` for `nr <= ROW_TILE` rows of `rb` bytes each.
/// `w.len() == nr·rb`, `rb == x.len()·20`; `kernel.supported()`.
fn dot_rows(kernel: Kernel, w: &[u8], rb: usize, nr: usize, x: &[BlockQ8_1], res: &mut [f32; ROW_TILE]) {
    debug_assert!(w.len() == nr * rb && rb == x.len() * Q4_1_BLOCK_BYTES);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            // SAFETY: the kernel reaches here only after `matmul_q8_1` checked `kernel.supported()`,
            // i.e. that the CPU has AVX2, FMA and F16C; `w` holds `nr` rows of
            // `rb = 20·x.len()` bytes, which is what the kernels read (sliced in `tile`).
            unsafe {
                match nr {
                    4 => avx2::dot_q4_1_q8_1::<4>(w, rb, x, res),
                    3 => avx2::dot_q4_1_q8_1::<3>(w, rb, x, res),
                    2 => avx2::dot_q4_1_q8_1::<2>(w, rb, x, res),
                    _ => avx2::dot_q4_1_q8_1::<1>(w, rb, x, res),
                }
            }
        }
        _ => match nr {
            4 => scalar_dot::<4>(w, rb, x, res),
            3 => scalar_dot::<3>(w, rb, x, res),
            2 => scalar_dot::<2>(w, rb, x, res),
            _ => scalar_dot::<1>(w, rb, x, res),
        },
    }
}

fn f16_bits(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The portable kernel: `R` rows sharing each activation block.
fn scalar_dot<const R: usize>(w: &[u8], rb: usize, x: &[BlockQ8_1], res: &mut [f32; ROW_TILE]) {
    let mut acc = [0f32; R];
    for (b, xb) in x.iter().enumerate() {
        for (r, a) in acc.iter_mut().enumerate() {
            let blk = &w[r * rb + b * Q4_1_BLOCK_BYTES..r * rb + (b + 1) * Q4_1_BLOCK_BYTES];
            let (d, m) = (f16_bits(blk, 0), f16_bits(blk, 2));
            let mut sumi = 0i32;
            for j in 0..QK / 2 {
                let q = blk[4 + j];
                sumi += i32::from(q & 0x0f) * i32::from(xb.qs[j]) + i32::from(q >> 4) * i32::from(xb.qs[j + QK / 2]);
            }
            *a += d * xb.d * sumi as f32 + m * xb.s;
        }
    }
    res[..R].copy_from_slice(&acc);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ8_1, Q4_1_BLOCK_BYTES, ROW_TILE};

    /// How far ahead in each weight row the kernels prefetch.
    const PREFETCH_BYTES: usize = 384;

    /// Horizontal sum of 8 floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The body of the row-tile kernels; `$dot(qx, qy)` is the i32x8 byte dot product.
    macro_rules! q4_1_kernel {
        ($w:ident, $rb:ident, $x:ident, $res:ident, $R:ident, $dot:expr) => {{
            let low = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); $R];
            // Lane 1 of each accumulates m_w·s_x; lane 0 holds Σ d_w·d_x (unused).
            let mut accm = [_mm_setzero_ps(); $R];
            let wp = $w.as_ptr();
            for (b, xb) in $x.iter().enumerate() {
                // SAFETY: `xb.qs` is 32 bytes; unaligned load.
                let qy = unsafe { _mm256_loadu_si256(xb.qs.as_ptr().cast()) };
                let dxsx = _mm_setr_ps(xb.d, xb.s, 0.0, 0.0);
                for r in 0..$R {
                    // SAFETY: r < R and b < x.len(), so the block spans bytes
                    // r·rb + 20b .. r·rb + 20(b+1) <= R·rb <= w.len() (caller contract).
                    let p = unsafe { wp.add(r * $rb + b * Q4_1_BLOCK_BYTES) };
                    // Prefetch a few cache lines ahead in this row; a prefetch never faults, and
                    // `wrapping_add` keeps the address computation defined past the row's end.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES).cast());
                    // SAFETY: 4 bytes (f16 d, f16 m) at the block start, in bounds as above.
                    let dm_bits = unsafe { p.cast::<i32>().read_unaligned() };
                    let dm = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)), dxsx); // [d·dx, m·sx, 0, 0]
                    accm[r] = _mm_add_ps(accm[r], dm);
                    // SAFETY: the 16 nibble bytes at block offset 4..20, in bounds as above.
                    let tmp = unsafe { _mm_loadu_si128(p.add(4).cast()) };
                    // Low nibbles are elements 0..16, high nibbles 16..32.
                    let qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp), low);
                    let dot: __m256i = $dot(qx, qy);
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(dot), acc[r]);
                }
            }
            for r in 0..$R {
                let m_term = _mm_cvtss_f32(_mm_movehdup_ps(accm[r]));
                $res[r] = hsum(acc[r]) + m_term;
            }
        }};
    }

    /// `res[r] = Σ_b d_w·d_x·Σ q_w·q_x + m_w·s_x` over the blocks of row `r < R` of `w`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C. `w` must hold at least `R·rb` bytes, and
    /// `rb` must equal `x.len()·20` (each row is `x.len()` Q4_1 blocks). `R <= ROW_TILE`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_q8_1<const R: usize>(
        w: &[u8],
        rb: usize,
        x: &[BlockQ8_1],
        res: &mut [f32; ROW_TILE],
    ) {
        let ones = _mm256_set1_epi16(1);
        // u8 (0..15) × i8 (|q| <= 127): pair sums <= 3810, no i16 saturation.
        q4_1_kernel!(w, rb, x, res, R, |qx, qy| _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones))
    }
}

/// A linear layer's weight, ready for the CPU forward pass.
#[derive(Debug)]
pub enum CpuLinear {
    /// Dense weights, or quantized types candle has SIMD kernels for (see `Linear::qmatmul`).
    Candle(QMatMul),
    /// Q4_1 blocks, multiplied by this module's kernels.
    Q4_1(Q41Matrix),
}

impl CpuLinear {
    /// `x · Wᵀ` for `x` of shape `[.., in]`; returns `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            CpuLinear::Candle(q) => Ok(q.forward(x)?),
            CpuLinear::Q4_1(w) => q4_1_forward(w, x),
        }
    }

    /// The Q4_1 matrix, when this layer runs on ferrum's kernel.
    pub fn q4_1(&self) -> Option<&Q41Matrix> {
        match self {
            CpuLinear::Q4_1(w) => Some(w),
            CpuLinear::Candle(_) => None,
        }
    }
}

/// Linear layers that read the same input (q/k/v, gate/up). When every part is Q4_1 of the
/// same width they run as one stacked matrix: one activation quantization and one fork/join
/// instead of several, which matters for the small decode matmuls.
#[derive(Debug)]
pub enum ProjGroup {
    /// One stacked Q4_1 matrix; the parts' output widths, in order.
    Fused(Q41Matrix, Vec<usize>),
    /// One operator per part.
    Split(Vec<CpuLinear>),
}

impl ProjGroup {
    /// Builds the group of `parts` (all `[out_i, in]`).
    pub fn new(parts: &[&crate::weights::Linear]) -> Result<Self> {
        use crate::weights::Linear;
        let q4_1: Option<Vec<Q41Matrix>> = parts
            .iter()
            .map(|l| match l {
                Linear::Quantized(q) if q.dtype() == GgmlDType::Q4_1 => Some(Q41Matrix::from_qtensor(q)),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(|v| v.into_iter().collect::<Result<Vec<_>>>())
            .transpose()?;
        match q4_1 {
            Some(ms) if ms.windows(2).all(|w| w[0].cols() == w[1].cols()) => {
                let widths = ms.iter().map(Q41Matrix::rows).collect();
                Ok(ProjGroup::Fused(Q41Matrix::concat_rows(&ms.iter().collect::<Vec<_>>())?, widths))
            }
            _ => Ok(ProjGroup::Split(parts.iter().map(|l| l.cpu_linear()).collect::<Result<_>>()?)),
        }
    }

    /// Each part's `x · Wᵀ` for `x` of shape `[T, in]` (fused parts are column views).
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            ProjGroup::Split(ls) => ls.iter().map(|l| l.forward(x)).collect(),
            ProjGroup::Fused(w, widths) => {
                let y = q4_1_forward(w, x)?;
                let last = y.rank().saturating_sub(1);
                let mut off = 0;
                let mut out = Vec::with_capacity(widths.len());
                for &n in widths {
                    out.push(y.narrow(last, off, n)?);
                    off += n;
                }
                Ok(out)
            }
        }
    }
}

fn q4_1_forward(w: &Q41Matrix, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let k = dims.last().copied().unwrap_or(0);
    if k != w.cols() {
        return Err(Error::InvalidInput(format!("Q4_1 matmul: input {dims:?} against weight [{}, {k}]", w.rows())));
    }
    let m = x.elem_count() / k;
    let x = x.to_dtype(DType::F32)?.contiguous()?;
    let mut out = vec![0f32; m * w.rows()];
    {
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(Error::InvalidInput("the Q4_1 CPU matmul needs a CPU tensor".into()));
        };
        let all = cpu.as_slice::<f32>()?;
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| Error::InvalidInput("Q4_1 matmul: input is not contiguous".into()))?;
        let xs = all.get(start..end).ok_or_else(|| Error::InvalidInput("Q4_1 matmul: bad input layout".into()))?;
        w.matmul(xs, m, &mut out)?;
    }
    let mut out_dims = dims.to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = w.rows();
    }
    Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random Q4_1 bytes with realistic scales: d in (0, 0.02], m in [-0.15, 0).
    fn random_q4_1(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
        let nb = rows * cols / QK;
        let mut out = Vec::with_capacity(nb * Q4_1_BLOCK_BYTES);
        for _ in 0..nb {
            let d = half::f16::from_f32(rng.random_range(0.001f32..0.02));
            let m = half::f16::from_f32(rng.random_range(-0.15f32..-0.01));
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            out.extend_from_slice(&m.to_bits().to_le_bytes());
            for _ in 0..QK / 2 {
                out.push(rng.random::<u8>());
            }
        }
        out
    }

    fn dequantize(w: &Q41Matrix) -> Vec<f32> {
        let mut out = Vec::with_capacity(w.rows * w.cols);
        for blk in w.data.chunks_exact(Q4_1_BLOCK_BYTES) {
            let (d, m) = (f16_bits(blk, 0), f16_bits(blk, 2));
            let lo: Vec<f32> = blk[4..].iter().map(|&q| d * f32::from(q & 0x0f) + m).collect();
            let hi: Vec<f32> = blk[4..].iter().map(|&q| d * f32::from(q >> 4) + m).collect();
            out.extend(lo);
            out.extend(hi);
        }
        out
    }

    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-30)).sqrt()
    }

    #[test]
    fn kernels_match_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(n, k, m) in &[
            (1, 32, 1),
            (3, 64, 1),
            (5, 576, 1),
            (7, 576, 3),
            (576, 576, 1),
            (193, 1536, 1),
            (64, 1536, 5),
            (1538, 576, 2),
        ] {
            let w = Q41Matrix::from_bytes(n, k, random_q4_1(&mut rng, n, k)).unwrap();
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let dense = dequantize(&w);
            let reference: Vec<f32> = (0..m)
                .flat_map(|i| {
                    let xr = &x[i * k..(i + 1) * k];
                    dense
                        .chunks_exact(k)
                        .map(move |wr| wr.iter().zip(xr).map(|(a, b)| a * b).sum::<f32>())
                        .collect::<Vec<_>>()
                })
                .collect();
            let mut scalar = vec![0f32; m * n];
            w.matmul_with(Kernel::Scalar, &x, m, &mut scalar).unwrap();
            let e = rel(&scalar, &reference);
            assert!(e <= 1e-2, "scalar vs f32 ({n}x{k}, m={m}): {e}");
            for kern in [Kernel::Avx2].into_iter().filter(|k| k.supported()) {
                let mut simd = vec![0f32; m * n];
                w.matmul_with(kern, &x, m, &mut simd).unwrap();
                let e = rel(&simd, &scalar);
                assert!(e <= 2e-6, "{kern:?} vs scalar ({n}x{k}, m={m}): {e}");
            }
        }
    }

    #[test]
    fn matches_candle_dequantized_matmul() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (n, k, m) = (67, 576, 4);
        let bytes = random_q4_1(&mut rng, n, k);
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Borrowed(&bytes),
            &Device::Cpu,
            GgmlDType::Q4_1,
        )
        .unwrap();
        let q = QTensor::new(storage, (n, k)).unwrap();
        let w = Q41Matrix::from_qtensor(&q).unwrap();
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let want = x.matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap();
        let got = CpuLinear::Q4_1(w).forward(&x).unwrap();
        assert_eq!(got.dims(), &[m, n]);
        let e = rel(&got.flatten_all().unwrap().to_vec1().unwrap(), &want.flatten_all().unwrap().to_vec1().unwrap());
        assert!(e <= 1e-2, "{e}");
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(Q41Matrix::from_bytes(2, 48, vec![0; 40]).is_err());
        assert!(Q41Matrix::from_bytes(2, 32, vec![0; 39]).is_err());
        let w = Q41Matrix::from_bytes(2, 32, vec![0; 40]).unwrap();
        assert!(w.matmul(&[0.0; 31], 1, &mut [0.0; 2]).is_err());
        assert!(w.matmul(&[0.0; 32], 1, &mut [0.0; 3]).is_err());
        let stacked = Q41Matrix::concat_rows(&[&w, &w]).unwrap();
        assert_eq!((stacked.rows(), stacked.cols()), (4, 32));
    }

    #[test]
    fn quantize_q8_1_roundtrip() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) * 0.37).collect();
        let mut q = vec![BlockQ8_1::default(); 2];
        quantize_row_q8_1(&x, &mut q).unwrap();
        for (xb, qb) in x.chunks_exact(QK).zip(&q) {
            let s: i32 = qb.qs.iter().map(|&v| i32::from(v)).sum();
            assert!((qb.s - qb.d * s as f32).abs() < 1e-5);
            for (&v, &qv) in xb.iter().zip(&qb.qs) {
                assert!((v - qb.d * f32::from(qv)).abs() <= qb.d * 0.5 + 1e-6);
            }
        }
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    use std::time::Instant;

    /// `cargo test --release -p ferrum-runner --lib cpu_quant::bench -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn throughput() {
        for &(n, k) in &[(192usize, 576usize), (576, 576), (1536, 576), (576, 1536), (3072, 576), (49152, 576)] {
            let data: Vec<u8> = (0..n * k / QK * Q4_1_BLOCK_BYTES).map(|i| (i * 31 % 251) as u8).collect();
            let w = Q41Matrix::from_bytes(n, k, data).unwrap();
            let x: Vec<f32> = (0..k).map(|i| (i as f32).sin()).collect();
            let mut out = vec![0f32; n];
            for (name, kern) in [("avx2", Kernel::Avx2), ("scalar", Kernel::Scalar)] {
                let iters = if kern == Kernel::Scalar { 20 } else { 2000 * 576 * 576 / (n * k) + 20 };
                w.matmul_with(kern, &x, 1, &mut out).unwrap();
                let t = Instant::now();
                for _ in 0..iters {
                    w.matmul_with(kern, &x, 1, &mut out).unwrap();
                }
                let dt = t.elapsed().as_secs_f64() / iters as f64;
                println!(
                    "{name:6} {n:5}x{k:4}: {:8.2} us/call, {:6.2} GB/s",
                    dt * 1e6,
                    w.size_in_bytes() as f64 / dt / 1e9
                );
            }
        }
    }

    /// Decode-step split on the real model: all matmuls alone vs a whole `decode_step`.
    #[test]
    #[ignore]
    fn model_split() {
        let path = std::path::Path::new("/root/.cache/ferrum/SmolLM2-135M-Instruct.Q4_1.gguf");
        let Ok(lm) = crate::load::load_model(path, crate::weights::WeightFormat::Quantized) else { return };
        let w = &lm.weights;
        let mut lins = Vec::new();
        for l in &w.layers {
            for x in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                lins.push(x.cpu_linear().unwrap());
            }
        }
        let old: Vec<CpuLinear> = w
            .layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
            .map(|x| CpuLinear::Candle(x.qmatmul().unwrap()))
            .collect();
        let head = w.lm_head.cpu_linear().unwrap();
        let xs: Vec<Tensor> =
            [576usize, 1536].iter().map(|&k| Tensor::randn(0f32, 1.0, (1, k), &Device::Cpu).unwrap()).collect();
        let pick = |l: &CpuLinear| if l.q4_1().map(|q| q.cols()) == Some(1536) { &xs[1] } else { &xs[0] };
        for _ in 0..3 {
            let t = Instant::now();
            let iters = 50;
            for _ in 0..iters {
                for l in &lins {
                    l.forward(pick(l)).unwrap();
                }
            }
            let tl = t.elapsed().as_secs_f64() / iters as f64;
            let t = Instant::now();
            for _ in 0..iters {
                for (l, o) in lins.iter().zip(&old) {
                    o.forward(pick(l)).unwrap();
                }
            }
            let to = t.elapsed().as_secs_f64() / iters as f64;
            let t = Instant::now();
            for _ in 0..iters {
                head.forward(&xs[0]).unwrap();
            }
            let th = t.elapsed().as_secs_f64() / iters as f64;
            let model = crate::model::CpuModel::new(w).unwrap();
            let mut cache = model.new_cache(256).unwrap();
            model.prefill(&mut cache, &[1, 2, 3]).unwrap();
            let t = Instant::now();
            for i in 0..iters {
                model.decode_step(&mut cache, 100 + i as u32).unwrap();
            }
            let td = t.elapsed().as_secs_f64() / iters as f64;
            println!(
                "layers' matmuls: Q4_1 kernel {:.2} ms, via Q8_0 {:.2} ms; lm head {:.2} ms; decode step {:.2} ms",
                tl * 1e3,
                to * 1e3,
                th * 1e3,
                td * 1e3
            );
        }
    }
}
