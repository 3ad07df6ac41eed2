//! One typed Rust function per kernel (and per cuBLAS call). Each takes [`Region`]s — device
//! pointers whose extent was checked against their allocation — and checks, before launching,
//! that every region covers what the kernel touches for the given dimensions.
use super::DevBuf;
use crate::error::{Error, Result};
use crate::kernel_list::Kernel;
use crate::ptx;
use crate::spec::{DType, Fusion};
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::sys as cu;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, CudaViewMut, DevicePtr, DeviceRepr, DriverError,
    LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;

/// A bounds-checked piece of a device allocation: `len` elements of `T` from `ptr`.
/// Borrowing the allocation for `'a` keeps it alive while the region is used.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region<'a, T> {
    ptr: u64,
    len: usize,
    _buf: PhantomData<&'a T>,
}

impl<T> Region<'_, T> {
    /// The null region (an absent optional argument; kernels test for null).
    pub(crate) fn null() -> Self {
        Region { ptr: 0, len: 0, _buf: PhantomData }
    }
    fn need(&self, n: usize, what: &str) -> Result<u64> {
        if n > self.len {
            return Err(Error::Internal(format!("{what}: needs {n} elements, region holds {}", self.len)));
        }
        Ok(self.ptr)
    }
    /// Pointer for an optional argument: null when the region is null, else checked like `need`.
    fn opt(&self, n: usize, what: &str) -> Result<u64> {
        if self.ptr == 0 {
            Ok(0)
        } else {
            self.need(n, what)
        }
    }
}

/// `len` elements of `buf` from element `offset`, checked against the allocation.
pub(crate) fn region<'a, T>(
    buf: &'a DevBuf<T>,
    stream: &CudaStream,
    offset: usize,
    len: usize,
) -> Result<Region<'a, T>> {
    let end = offset.checked_add(len).ok_or_else(|| Error::Internal("region overflows".into()))?;
    if end > buf.len() {
        return Err(Error::Internal(format!("region {offset}..{end} outside an allocation of {} elements", buf.len())));
    }
    // Event tracking is off for the runner's context (one stream), so the guard returned with
    // the pointer does nothing and can be dropped at once.
    let (base, _guard) = buf.device_ptr(stream);
    Ok(Region { ptr: base + (offset * std::mem::size_of::<T>()) as u64, len, _buf: PhantomData })
}

/// A whole allocation as a region.
pub(crate) fn whole<'a, T>(buf: &'a DevBuf<T>, stream: &CudaStream) -> Result<Region<'a, T>> {
    region(buf, stream, 0, buf.len())
}

fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Internal(format!("{what} = {v} does not fit in i32")))
}

fn grid1(n: usize) -> Result<u32> {
    u32::try_from(n.max(1)).map_err(|_| Error::Internal(format!("grid {n} too large")))
}

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    cfg_2d(grid, (block, 1, 1))
}

fn cfg_2d(grid: (u32, u32, u32), block: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: 0 }
}

fn pick(dtype: DType, f16: Kernel, bf16: Kernel) -> Kernel {
    match dtype {
        DType::F16 => f16,
        DType::BF16 => bf16,
    }
}

/// Block size for row-wise norms.
fn norm_block(hidden: usize) -> u32 {
    if hidden >= 4096 {
        1024
    } else if hidden >= 1024 {
        512
    } else {
        256
    }
}

/// The device-fed step state the argmax updates: the decode step buffer `[token, position]`
/// and the sequence's token history (`capacity + 1` entries, indexed by position).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Feed<'a> {
    pub(crate) step: Region<'a, u32>,
    pub(crate) history: Region<'a, u32>,
    pub(crate) capacity: usize,
}

/// A feed's kernel arguments: (step, history, capacity), nulls without one.
fn feed_args(feed: &Option<Feed<'_>>) -> Result<(u64, u64, i32)> {
    Ok(match feed {
        Some(f) => (
            f.step.need(2, "argmax step")?,
            f.history.need(f.capacity + 1, "argmax history")?,
            i32_of(f.capacity, "capacity")?,
        ),
        None => (0, 0, 0),
    })
}

/// Rows of the head a block of the screen kernel covers (misc.cu: 8 warps of 8 rows).
const HEAD_ROWS_PER_BLOCK: usize = 64;
/// The widest head the screen takes: its input in shared memory, padded to 5 bytes a column
/// (misc.cu's xs_at), within the default 48 KiB allowance.
pub(crate) const HEAD_MAX_COLS: usize = 8192;

/// The widest hidden size the folded q/k/v projection's builder takes (its shared memory).
pub(crate) const FOLD_MAX_HIDDEN: usize = 8192;

/// The screened LM head's buffers for one step (misc.cu; `CudaDecodeRunner::set_screened_head`):
/// the int8 copy of the rows a step covers, their scales and bound coefficients, the overflow
/// guard `(1 + gamma) max |w|` rounded up, the hand-off state (floor, count) and the list (a
/// (logit bits, row) pair a row), and the vocabulary index of the first row.
pub(crate) struct HeadScreen<'a> {
    pub(crate) q: Region<'a, i8>,
    pub(crate) scale: Region<'a, f32>,
    pub(crate) coef: Region<'a, f32>,
    pub(crate) ovf: f32,
    pub(crate) state: Region<'a, i32>,
    pub(crate) list: Region<'a, u32>,
    pub(crate) base: usize,
}

/// A TP rank's share of the argmax under a vocab split: its logits are the LM head rows
/// `[base, base + n)`, and its best candidate goes to slot `rank` of the exchange buffer `xchg`
/// (`2 * world` floats; misc.cu's `ferrum_argmax_final`) instead of to the token.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ArgmaxSplit<'a> {
    pub(crate) base: usize,
    pub(crate) xchg: Region<'a, f32>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

/// Most arguments of a ferrum kernel (checked against the PTX by `cargo xtask ptx --check`).
const MAX_ARGS: usize = crate::kernel_list::MAX_KERNEL_ARGS;

/// One kernel launch being assembled (cudarc's `LaunchArgs`, plus programmatic dependent launch):
/// the function, the stream, and pointers to the argument values, which are borrowed for `'a`
/// so they outlive the launch call. No allocation.
pub(crate) struct Launch<'a> {
    func: &'a CudaFunction,
    kernel: Kernel,
    stream: &'a CudaStream,
    args: [*mut std::ffi::c_void; MAX_ARGS],
    n: usize,
    pdl: bool,
    /// Blocks per thread-block cluster along y (the attention's splits), 0 for no cluster.
    cluster_y: u32,
    /// When profiling ([`Kernels::marks`] is `Some`), an event is recorded after the launch.
    marks: &'a RefCell<Option<Vec<(&'static str, CudaEvent)>>>,
}

impl<'a> Launch<'a> {
    /// Appends a kernel argument (its value is read by the driver at launch).
    pub(crate) fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        if self.n < MAX_ARGS {
            self.args[self.n] = v as *const T as *mut std::ffi::c_void;
        }
        // Past MAX_ARGS the count still grows, and `launch` refuses.
        self.n += 1;
        self
    }

    /// Launches the blocks as thread-block clusters of `(1, y, 1)` blocks (the grid's y extent
    /// must be a multiple of `y`; at most 8, the portable cluster size).
    pub(crate) fn cluster_y(&mut self, y: u32) -> &mut Self {
        self.cluster_y = y;
        self
    }

    /// Launches with `cuLaunchKernelEx` on the stream; with programmatic dependent launch
    /// allowed when the kernels were built for it (the compute_90 PTX, whose kernels all wait
    /// with `griddepcontrol.wait` before touching memory an earlier kernel writes; the GEMVs
    /// load their first weight chunks before it: see `FERRUM_PDL_ENTRY` in common.cuh), and
    /// with the cluster shape set by [`Self::cluster_y`].
    ///
    /// # Safety
    /// The arguments must match the kernel's parameter list in number, order and type, and
    /// every memory access the kernel makes with them must be in bounds (each caller checks the
    /// extents and says so in its `SAFETY` comment).
    pub(crate) unsafe fn launch(&mut self, c: LaunchConfig) -> Result<(), DriverError> {
        if self.n > MAX_ARGS {
            return Err(DriverError(cu::CUresult::CUDA_ERROR_INVALID_VALUE));
        }
        self.stream.context().bind_to_thread()?;
        // SAFETY: an all-zero CUlaunchAttribute is a valid (plain C) value; each union field
        // written below is the one its id selects.
        let mut attrs: [cu::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n_attrs = 0;
        if self.pdl {
            attrs[n_attrs].id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if self.cluster_y > 0 {
            attrs[n_attrs].id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n_attrs].value.clusterDim.x = 1;
            attrs[n_attrs].value.clusterDim.y = self.cluster_y;
            attrs[n_attrs].value.clusterDim.z = 1;
            n_attrs += 1;
        }
        let config = cu::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if n_attrs > 0 { attrs.as_mut_ptr() } else { std::ptr::null_mut() },
            numAttrs: n_attrs as u32,
        };
        // SAFETY: `config` and `attrs` live across the call; `args[..n]` point to argument values
        // borrowed for 'a (alive), matching the kernel's parameters per this function's
        // contract; the function belongs to the stream's context (loaded in `Kernels::load`).
        unsafe { cu::cuLaunchKernelEx(&config, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
        self.mark()
    }

    /// Profiling only (cold): records an event after this launch.
    #[cold]
    fn mark_slow(&self, marks: &mut Vec<(&'static str, CudaEvent)>) -> Result<(), DriverError> {
        record_mark(self.stream, marks, self.kernel.name())
    }

    #[inline]
    fn mark(&self) -> Result<(), DriverError> {
        match self.marks.borrow_mut().as_mut() {
            None => Ok(()),
            Some(marks) => self.mark_slow(marks),
        }
    }
}

/// Profiling only (cold): records a timing event named `what` on `stream` (the default flags;
/// `None` would disable timing).
#[cold]
fn record_mark(
    stream: &CudaStream,
    marks: &mut Vec<(&'static str, CudaEvent)>,
    what: &'static str,
) -> Result<(), DriverError> {
    let ev = stream.context().new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
    ev.record(stream)?;
    marks.push((what, ev));
    Ok(())
}

/// What the decode attention needs to do RoPE itself ([`Kernels::attn`] with `rope`): the
/// inputs of [`Kernels::rope_qkv`] (null regions for the optional bias and norms).
#[derive(Clone, Copy)]
pub(crate) struct AttnRope<'a> {
    pub bias: Region<'a, u16>,
    pub q_norm: Region<'a, u16>,
    pub k_norm: Region<'a, u16>,
    pub inv_freq: Region<'a, f32>,
    pub eps: f32,
    /// The folded q/k/v projection (fold.cu's fold_qkv; null otherwise): the row is u, q/k/v
    /// before the layer's RMSNorm scalar, and this is the residual `[hidden]` it normalises.
    pub pre: Region<'a, f32>,
    /// Copy the split's past K/V rows to shared memory before the programmatic-launch wait
    /// (`plan::attn_warps` says when; the launch then gets `plan::attn_dyn_bytes` of dynamic
    /// shared memory).
    pub early: bool,
}

/// What the decode attention needs to add the o projection to the residual itself
/// ([`Kernels::attn`] with `o`: the "o" fusion, `ferrum_attn_rope[_early]_o_*`).
#[derive(Clone, Copy)]
pub(crate) struct AttnO<'a> {
    /// `[hidden][heads * head_dim]`
    pub wo: Region<'a, u16>,
    /// The residual `[hidden]`: x += W_o attn.
    pub x: Region<'a, f32>,
    /// Scratch for each head's partial, `[heads][hidden]`.
    pub part: Region<'a, f32>,
    /// One ticket counter per block of a cluster (`plan::ATTN_MAX_CLUSTER`), zero between
    /// launches (each row range's last block wraps its counter back).
    pub ticket: Region<'a, u32>,
    pub hidden: usize,
}

/// The widest hidden size whose decode step fuses the residual adds and norms into the GEMVs,
/// unless `FERRUM_FUSED_NORMS_MAX_HIDDEN` says otherwise. Measured on an H200 (bf16, `ferrum
/// bench`): session 9, fused vs `FERRUM_FUSE=0`, hidden 576 (135M) +15%, 2048 (1B) +5%, 4096
/// (8B) −10%; session 16, after the `_res` GEMVs learned to load the residual stream before the
/// programmatic-launch wait, 4096 fused vs unfused +3.4% (median of four alternating rounds).
/// Wider models (8192) are unmeasured and keep the separate add + RMSNorm kernels.
pub(crate) const FUSED_NORMS_MAX_HIDDEN: usize = 4096;

/// The decode attention kernels: the row-walking ones (attention.cu's `attn_impl`), whose
/// launches take the dynamic shared memory of `plan::attn_dyn_bytes`, and the compact one
/// (`attn_compact_hd64`, `plan::attn_compact_dyn_bytes`), all set up at load for up to
/// `plan::attn_max_dyn_bytes`.
fn is_decode_attention(k: Kernel) -> bool {
    use Kernel::*;
    matches!(
        k,
        AttnF16
            | AttnBf16
            | AttnRopeF16
            | AttnRopeBf16
            | AttnRopeEarlyF16
            | AttnRopeEarlyBf16
            | AttnRopeHd128F16
            | AttnRopeHd128Bf16
            | AttnRopeEarlyHd128F16
            | AttnRopeEarlyHd128Bf16
            | AttnRopeEarlyCompactHd64F16
            | AttnRopeEarlyCompactHd64Bf16
            | AttnRopeFoldHd64F16
            | AttnRopeFoldHd64Bf16
            | AttnRopeEarlyFoldHd64F16
            | AttnRopeEarlyFoldHd64Bf16
            | AttnRopeFoldHd128F16
            | AttnRopeFoldHd128Bf16
            | AttnRopeEarlyFoldHd128F16
            | AttnRopeEarlyFoldHd128Bf16
    )
}

/// The o-fused decode attention kernels (`AttnRope*O*`), whose launches add
/// `plan::attn_o_bytes` to `plan::attn_dyn_bytes`.
fn is_o_attention(k: Kernel) -> bool {
    use Kernel::*;
    matches!(k, AttnRopeOHd64F16 | AttnRopeOHd64Bf16 | AttnRopeEarlyOHd64F16 | AttnRopeEarlyOHd64Bf16)
}

/// The loaded kernels and the cuBLAS handle, bound to one stream.
pub(crate) struct Kernels {
    funcs: Vec<CudaFunction>,
    modules: Vec<Arc<CudaModule>>,
    pub(crate) stream: Arc<CudaStream>,
    blas: CudaBlas,
    pub(crate) dtype: DType,
    /// The GEMV variant per shape (filled by the runner's start-up tuning).
    pub(crate) gemv_table: GemvTable,
    /// The variants (indices into [`GEMV_VARIANTS`]) a step-level tuning may choose among per
    /// shape (`CudaDecodeRunner::set_gemv_variant`): all of them, or the one
    /// `FERRUM_GEMV_VARIANT` forces.
    pub(crate) gemv_candidates: std::collections::HashMap<(usize, usize, bool), Vec<usize>>,
    /// Kernels launch with programmatic dependent launch (compute_90 PTX on an sm_90+ GPU).
    pub(crate) pdl: bool,
    /// Decode steps merge the split-KV partials in the attention kernel's last split block
    /// (else in a combine kernel; bit-identical either way).
    pub(crate) fuse_merge: bool,
    /// With `fuse_merge` on the compute_90 kernels (`pdl`) and at most
    /// `plan::ATTN_MAX_CLUSTER` splits, the split blocks of each head run as one thread-block
    /// cluster and merge through distributed shared memory (bit-identical, except where the
    /// compact kernel takes the case: `attn_compact`).
    pub(crate) fuse_cluster: bool,
    /// One-GPU decode steps fuse the residual adds and RMSNorms into the projections (gemv.cu's
    /// `_res` / `_norm` kernels; the same math, other f32 rounding).
    pub(crate) fuse_norms: bool,
    /// Decode steps (one token) do RoPE and the K/V append inside the attention kernel
    /// (`ferrum_attn_rope_*`; bit-identical to the separate rope kernel, except where the
    /// compact kernel takes the case: `attn_compact`).
    pub(crate) fuse_rope: bool,
    /// The widest hidden size whose one-GPU decode fuses the norms into the GEMVs
    /// ([`FUSED_NORMS_MAX_HIDDEN`], or `FERRUM_FUSED_NORMS_MAX_HIDDEN`).
    pub(crate) norms_max_hidden: usize,
    /// `FERRUM_GEMV_WARPS_PER_SM`: the two-row warps per multiprocessor that the split-K
    /// factor aims at (default `plan::GEMV_WARPS_PER_SM`).
    pub(crate) gemv_warps_per_sm: usize,
    /// `FERRUM_GEMV_LANES`: lanes per row group of the short-row GEMVs instead of
    /// `plan::gemv_lanes_per_row`'s choice.
    pub(crate) gemv_lanes: Option<u32>,
    /// `FERRUM_GEMV_SPLIT_K`: the largest GEMV split-K factor (1 turns split-K off; default
    /// `plan::GEMV_MAX_KS`).
    pub(crate) gemv_max_ks: u32,
    /// `FERRUM_GEMV_KS_EXACT`: the largest split that `plan::gemv_split_k_exact` may raise a
    /// shape's split-K to (one column stripe per warp; 0: off).
    pub(crate) gemv_ks_exact: u32,
    /// Split-K factors for single shapes (`FERRUM_GEMV_KS_SHAPES`: `plan::gemv_ks_shapes`),
    /// `(rows, cols, ks)` with gate|up's rows counted twice.
    pub(crate) gemv_ks_shapes: Vec<(usize, usize, u32)>,
    /// The GEMV tuning's tie margin in tenths of a percent (`plan::GEMV_TIE_PERMILLE`, or
    /// `FERRUM_GEMV_TIE`): among launches this close to the fastest, the fewest blocks win.
    pub(crate) gemv_tie: usize,
    /// Device-fed steps per captured graph (`plan::GRAPH_STEPS`, or `FERRUM_GRAPH_STEPS`):
    /// read here with the other knobs so that a bad value fails at load; used by the caller
    /// that captures the graphs.
    pub(crate) graph_steps: usize,
    /// `FERRUM_SCREEN_HEAD=1`: every new runner turns the screened head on
    /// (`CudaDecodeRunner::set_screened_head`; default off).
    pub(crate) screen_head: bool,
    /// `FERRUM_FOLD_QKV=1`: every new runner folds the q/k/v projection
    /// (`CudaDecodeRunner::set_folded_qkv`; default off).
    pub(crate) fold_qkv: bool,
    /// `FERRUM_ATTN_SPLITS`: a fixed KV split count for every new sequence (else chosen from
    /// the capacity).
    pub(crate) attn_splits: Option<usize>,
    /// `FERRUM_GEMV_VARIANT`: one launch variant (an index into [`GEMV_VARIANTS`]) for every
    /// GEMV shape instead of the start-up tuning's per-shape choice.
    pub(crate) gemv_variant: Option<usize>,
    /// Decode over caches of at least this many rows takes the tensor-core attention
    /// (`plan::attn_tensor_core`; `plan::ATTN_TC_MIN_CAPACITY`, or
    /// `FERRUM_ATTN_TC_MIN_CAPACITY`).
    pub(crate) attn_tc_min_capacity: usize,
    /// Shared-memory stages of the tensor-core decode attention (`plan::ATTN_TC_STAGES`, or
    /// `FERRUM_ATTN_TC_STAGES`).
    pub(crate) attn_tc_stages: usize,
    /// Whether the tensor-core decode attention issues tiles before the programmatic-launch
    /// wait (`plan::ATTN_TC_EARLY`, or `FERRUM_ATTN_TC_EARLY`).
    pub(crate) attn_tc_early: bool,
    /// The tensor-core decode attention's dynamic shared memory allowance (set at load: what
    /// the most stages need, or the GPU's opt-in limit per block where that is less).
    pub(crate) attn_tc_smem_max: u32,
    /// The o-fused decode attention's dynamic shared memory allowance (`plan::attn_o_smem_max`
    /// of the GPU's opt-in limit, set at load).
    pub(crate) attn_o_smem_max: u32,
    /// One-GPU decode steps add the o projection inside the attention where it applies
    /// (`FERRUM_ATTN_O`, default off: `plan::attn_o`).
    pub(crate) fuse_o: bool,
    /// The fused decode attention runs its own kernel for the head dims of
    /// `plan::ATTN_OWN_HEAD_DIMS` (`FERRUM_ATTN_HD_KERNELS`, default on; bit-identical).
    pub(crate) attn_head_dim_kernels: bool,
    /// The fused decode attention's one-token early-copy cluster case at head dim 64 without
    /// bias or norms runs the compact kernel (`FERRUM_ATTN_COMPACT`, default on:
    /// `plan::attn_compact`). Not bit-identical to the generic kernel: its sums over warps and
    /// splits run in another order (a GPU test bounds the difference).
    pub(crate) attn_compact: bool,
    /// Which one-GPU decode GEMVs let the next kernel launch before their wait
    /// (`FERRUM_EARLY_TRIGGER`, default `plan::EARLY_TRIGGER_DEFAULT`).
    pub(crate) early_trigger: crate::plan::EarlyTrigger,
    /// Which GEMVs load half their usual chunks before their wait
    /// (`FERRUM_GEMV_PF_HALF`, default `plan::HALF_PREFETCH_DEFAULT`). Bit-identical.
    pub(crate) half_prefetch: crate::plan::HalfPrefetch,
    /// The GPU's opt-in shared memory a block (`cuFuncSetAttribute`'s limit; the poison
    /// kernel's size).
    pub(crate) smem_optin: u32,
    /// `Some` while a step is profiled: every launch appends its kernel and an event recorded
    /// after it (see `CudaDecodeRunner::profile_decode_step`). `None` otherwise (no cost but
    /// one borrow check per launch).
    pub(crate) marks: RefCell<Option<Vec<(&'static str, CudaEvent)>>>,
    /// How the last decode step's attention merged its splits (for tests): `"none"` (one
    /// split), `"cluster"`, `"ticket"` or `"combine"`.
    pub(crate) last_merge: Cell<&'static str>,
    /// `Some` while a one-token device-fed step is encoded: every GEMV launch adds its shape
    /// (`(rows, cols, gate|up)`, as `gemv_table` keys it; see
    /// `CudaDecodeRunner::enqueue_device_step`). `None` otherwise.
    pub(crate) gemv_log: RefCell<Option<std::collections::BTreeSet<super::GemvKey>>>,
    /// TP decode steps over a peer group push the o / down partials from the GEMVs (see
    /// `Fusion::push`).
    pub(crate) fuse_push: bool,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("kernels", &self.funcs.len()).field("dtype", &self.dtype).finish()
    }
}

/// How a batch-1 GEMV meets its input and output: the one-GPU decode fusions (gemv.cu).
#[derive(Clone, Copy, Debug)]
pub(crate) enum GemvIo<'a> {
    /// `y = W x`.
    Plain,
    /// `y = W (RMSNorm(x) * w)`: x is the fp32 residual stream, `w` the norm weight (`cols`
    /// elements, in the dtype).
    Norm { w: Region<'a, u16>, eps: f32 },
    /// `y += W x`: y is the fp32 residual stream (the residual add fused in). The kernel reads
    /// y's old values before its programmatic-launch wait, so the kernel launched just before
    /// it on the stream must not write y (in the decode step the attention precedes the o
    /// projection and gate|up the down projection; gemv.cu's `gemv` gives the argument).
    ///
    /// `early_trigger` launches the `_res_et` kernels: the next kernel may launch at this one's
    /// entry, before its wait. The caller guarantees what common.cuh's early-trigger note asks:
    /// the next kernel reads nothing before its wait but weights, and this one's predecessor
    /// triggers after its own wait.
    AddTo { early_trigger: bool },
}

/// How a batch-1 GEMV is launched: rows per warp (2 or 4), threads per block, and the split-K
/// factor `ks` (warps sharing one row group, each over its own column stripes; see gemv.cu).
/// For one `ks`, every variant computes each dot product in the same order, so all give
/// bit-identical results; `ks` is fixed per shape by `plan::gemv_split_k_exact` (the target of
/// `FERRUM_GEMV_WARPS_PER_SM`, default `plan::GEMV_WARPS_PER_SM`; `FERRUM_GEMV_KS_SHAPES` may
/// name another for single shapes: `plan::gemv_ks_shapes`), and the runner times, per
/// shape at start-up, the variants whose busiest multiprocessor has the least work or within
/// `plan::GEMV_BALANCE_SLACK_PCT` of it (`plan::gemv_balanced`) and keeps the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GemvVariant {
    pub(crate) rows4: bool,
    pub(crate) block: u32,
    pub(crate) ks: u32,
}

impl Default for GemvVariant {
    fn default() -> Self {
        GEMV_VARIANTS[0]
    }
}

impl GemvVariant {
    /// Outputs one warp produces (`gateup`: one output takes two weight rows).
    fn outputs_per_warp(self, gateup: bool) -> usize {
        match (self.rows4, gateup) {
            (false, false) => 2,
            (false, true) => 1,
            (true, false) => 4,
            (true, true) => 2,
        }
    }
    /// Row groups per block (each `ks` warps).
    fn groups(self) -> usize {
        (self.block / 32 / self.ks.max(1)).max(1) as usize
    }
    /// Outputs one block computes: `outputs_per_warp` per row group with 32 lanes; with the
    /// short-row kernels (`lanes` < 32 lanes per two-row group, plain or `_norm` only, so never
    /// with `gateup`; `ks == 1`), `32 / lanes` two-row groups per warp.
    fn per_block(self, gateup: bool, lanes: u32) -> usize {
        let per_group = if lanes < 32 { 2 * (32 / lanes as usize) } else { self.outputs_per_warp(gateup) };
        per_group * self.groups()
    }
    fn grid(self, outputs: usize, gateup: bool) -> Result<u32> {
        grid1(outputs.div_ceil(self.per_block(gateup, 32)))
    }
    /// The grid of the short-row kernels (`lanes` < 32 lanes per two-row group, `ks == 1`).
    fn grid_lanes(self, outputs: usize, lanes: u32) -> Result<u32> {
        grid1(outputs.div_ceil(self.per_block(false, lanes)))
    }
    /// `(blocks, outputs per block)` of this variant's launch over `outputs` outputs, as
    /// `Kernels::gemv_as` / `gemv_gateup_io` / `gemv_push` launch it (`lanes` < 32: the
    /// short-row grid, which `gemv_as` takes for plain and `_norm` GEMVs only; the start-up
    /// tuning passes `plan::gemv_lanes_per_row`'s count, which is 32 for every shape a `_res`
    /// or `_push` GEMV has).
    pub(crate) fn blocks(self, outputs: usize, gateup: bool, lanes: u32) -> Result<(usize, usize)> {
        let grid = if lanes < 32 { self.grid_lanes(outputs, lanes)? } else { self.grid(outputs, gateup)? };
        Ok((grid as usize, self.per_block(gateup, lanes)))
    }
    /// Block shape: `(32 * groups, ks)`.
    fn block_dim(self) -> (u32, u32, u32) {
        (32 * self.groups() as u32, self.ks, 1)
    }
}

/// The GEMV launch variants the runner chooses from (with the shape's `ks`).
pub(crate) const GEMV_VARIANTS: [GemvVariant; crate::plan::GEMV_VARIANT_COUNT] = [
    GemvVariant { rows4: false, block: 256, ks: 1 },
    GemvVariant { rows4: false, block: 128, ks: 1 },
    GemvVariant { rows4: true, block: 256, ks: 1 },
    GemvVariant { rows4: true, block: 128, ks: 1 },
];

/// GEMV variant per `(rows, cols, gateup)` shape; shapes not listed use the default.
pub(crate) type GemvTable = std::collections::HashMap<(usize, usize, bool), GemvVariant>;
/// Logits per block of the argmax's first pass: 256 threads of misc.cu's `ARGMAX_PER` (4), so
/// each thread loads its logits in one round (4096 took 16 dependent rounds, 8.3 µs at a
/// 128k vocabulary in the decode step's kernel timeline).
pub(crate) const ARGMAX_CHUNK: usize = 1024;
pub(crate) use crate::plan::ATTN_MAX_WARPS;
/// Query rows per block and threads per block of the prefill attention (attention.cu's
/// `PF_BM` and `PF_WARPS * 32`).
const PREFILL_ROWS_PER_BLOCK: usize = 16 * crate::plan::PREFILL_WARPS as usize;
const PREFILL_THREADS: u32 = 32 * crate::plan::PREFILL_WARPS;

impl Kernels {
    /// Loads the kernels for `ctx`'s GPU: the compute_90 PTX with programmatic dependent launch
    /// on sm_90 and later (unless `FERRUM_PDL=0` is set), the compute_80 PTX otherwise.
    pub(crate) fn load(ctx: &Arc<CudaContext>, stream: Arc<CudaStream>, dtype: DType) -> Result<Self> {
        let (major, _) = ctx.compute_capability().map_err(Error::driver("compute capability"))?;
        let pdl = major >= 9 && std::env::var("FERRUM_PDL").map_or(true, |v| v.trim() != "0");
        let set = if pdl { ptx::MODULES_SM90 } else { ptx::MODULES };
        // Measurement knobs (A/B runs; documented in the crate README), all read before the
        // kernels load, so that a bad value fails fast (and the carveout sets a function
        // attribute at load). A value that is not UTF-8 is an error, not "unset".
        let env = |name: &str| crate::plan::knob_text(name, std::env::var(name));
        let knob = |name: &str, lo: usize, hi: usize| crate::plan::knob(name, env(name)?.as_deref(), lo, hi);
        // `FERRUM_SMEM_CARVEOUT=P`: every kernel prefers P% of the unified L1 / shared memory
        // as shared memory (by default the driver picks per kernel).
        let carveout = crate::plan::smem_carveout(env("FERRUM_SMEM_CARVEOUT")?.as_deref())?;
        // `FERRUM_ATTN_TC_CARVEOUT=P`: the same for the tensor-core decode attention alone.
        let attn_tc_carveout = crate::plan::attn_tc_carveout(env("FERRUM_ATTN_TC_CARVEOUT")?.as_deref())?;
        // `FERRUM_FUSE` picks the decode fusions (for A/B measurements; see `Fusion::parse`).
        let fusion = match env("FERRUM_FUSE")? {
            None => Fusion::ALL,
            Some(v) => Fusion::parse(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "FERRUM_FUSE={v:?}: expected 0, 1, or a comma-separated list of merge, norms, rope, cluster, push"
                ))
            })?,
        };
        // The other knobs: the widest hidden size whose decode fuses the norms, a fixed KV
        // split count for every sequence, one GEMV variant for every shape, the GEMV split-K
        // cap and target, the tensor-core attention threshold, and the head-dim kernels.
        let norms_max_hidden = knob("FERRUM_FUSED_NORMS_MAX_HIDDEN", 0, 1 << 20)?.unwrap_or(FUSED_NORMS_MAX_HIDDEN);
        let attn_splits = knob("FERRUM_ATTN_SPLITS", 1, crate::plan::MAX_SPLITS)?;
        let gemv_variant = crate::plan::gemv_variant(env("FERRUM_GEMV_VARIANT")?.as_deref())?;
        let gemv_max_ks = crate::plan::gemv_split_k_cap(env("FERRUM_GEMV_SPLIT_K")?.as_deref())?;
        let gemv_ks_exact = crate::plan::gemv_ks_exact(env("FERRUM_GEMV_KS_EXACT")?.as_deref())?;
        let gemv_ks_shapes = crate::plan::gemv_ks_shapes(env("FERRUM_GEMV_KS_SHAPES")?.as_deref())?;
        let gemv_tie = crate::plan::gemv_tie_permille(env("FERRUM_GEMV_TIE")?.as_deref())?;
        let graph_steps = crate::plan::graph_steps(env("FERRUM_GRAPH_STEPS")?.as_deref())?;
        let screen_head = crate::plan::screen_head(env("FERRUM_SCREEN_HEAD")?.as_deref())?;
        let fold_qkv = crate::plan::fold_qkv(env("FERRUM_FOLD_QKV")?.as_deref())?;
        let gemv_warps_per_sm = crate::plan::gemv_warps_per_sm(env("FERRUM_GEMV_WARPS_PER_SM")?.as_deref())?;
        let gemv_lanes = crate::plan::gemv_lanes(env("FERRUM_GEMV_LANES")?.as_deref())?;
        let attn_tc_min_capacity = crate::plan::attn_tc_min_capacity(env("FERRUM_ATTN_TC_MIN_CAPACITY")?.as_deref())?;
        let attn_tc_stages = crate::plan::attn_tc_stages(env("FERRUM_ATTN_TC_STAGES")?.as_deref())?;
        let attn_tc_early = crate::plan::attn_tc_early(env("FERRUM_ATTN_TC_EARLY")?.as_deref())?;
        let optin = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(Error::driver("device attribute"))?;
        // The same limit unsigned (0 if the driver gave a negative one: no opt-in).
        let optin_bytes = u32::try_from(optin).unwrap_or(0);
        let widest = crate::plan::PREFILL_HEAD_DIMS.iter().copied().max().unwrap_or(128);
        let attn_tc_smem_max =
            crate::plan::attn_gqa_dyn_bytes(crate::plan::ATTN_TC_MAX_STAGES, widest).min(optin_bytes.max(48 * 1024));
        let attn_o_smem_max = crate::plan::attn_o_smem_max(optin_bytes);
        let fuse_o = crate::plan::attn_o(env("FERRUM_ATTN_O")?.as_deref())?;
        let attn_head_dim_kernels = crate::plan::attn_head_dim_kernels(env("FERRUM_ATTN_HD_KERNELS")?.as_deref())?;
        let attn_compact = crate::plan::attn_compact(env("FERRUM_ATTN_COMPACT")?.as_deref())?;
        let early_trigger = crate::plan::early_trigger(env("FERRUM_EARLY_TRIGGER")?.as_deref())?;
        let half_prefetch = crate::plan::half_prefetch(env("FERRUM_GEMV_PF_HALF")?.as_deref())?;
        let mut modules = Vec::new();
        for (name, text) in set {
            let m = ctx
                .load_module(Ptx::from_src(*text))
                .map_err(|e| Error::Driver { what: "loading PTX", msg: format!("module {name}: {e}") })?;
            modules.push(m);
        }
        let mut funcs = Vec::with_capacity(Kernel::ALL.len());
        for k in Kernel::ALL {
            // Look each kernel up in its own module only (no probing: a failed lookup is a real
            // error, and it keeps compute-sanitizer's API-error log clean).
            let i = set.iter().position(|(n, _)| *n == k.module()).ok_or(Error::MissingKernel(k.name()))?;
            let f = modules[i].load_function(k.name()).map_err(|_| Error::MissingKernel(k.name()))?;
            if let Some(p) = carveout {
                f.set_attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, p as i32)
                    .map_err(Error::driver("shared memory carveout"))?;
            }
            if is_o_attention(*k) {
                // Their W_o slice comes on top of the other kernels' dynamic shared memory:
                // allowed attn_o_smem_max, within the GPU's opt-in limit beside the static part
                // (launches check that they fit it: plan::attn_o_fits).
                if attn_o_smem_max > 0 {
                    f.set_attribute(
                        cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        attn_o_smem_max as i32,
                    )
                    .map_err(Error::driver("o-fused attention shared memory size"))?;
                }
            }
            if is_decode_attention(*k) {
                // The cluster merge buffer and the early copies can take the static and dynamic
                // shared memory past the 48 KiB a block gets without opting in.
                let max = crate::plan::attn_max_dyn_bytes() as i32;
                f.set_attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max)
                    .map_err(Error::driver("attention shared memory size"))?;
            }
            if *k == Kernel::PoisonShared {
                // A block takes the whole opt-in shared memory (one block a multiprocessor),
                // with the largest shared-memory carveout, so it covers every byte a later
                // kernel's block can be given.
                f.set_attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin)
                    .map_err(Error::driver("poison kernel shared memory size"))?;
                f.set_attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                    .map_err(Error::driver("poison kernel carveout"))?;
            }
            if matches!(k, Kernel::AttnGqaF16 | Kernel::AttnGqaBf16) {
                // Its K/V stages are dynamic shared memory, past 48 KiB from three stages on
                // (at head dim 128): allowed what the most stages need at the largest head dim,
                // or the GPU's opt-in limit where that is less (launches fit their stage count
                // to it: attn_gqa), so a later stage count (set_attn_tc_stages) needs no new
                // attribute.
                f.set_attribute(
                    cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    attn_tc_smem_max as i32,
                )
                .map_err(Error::driver("tensor-core attention shared memory size"))?;
                if let Some(p) = attn_tc_carveout {
                    f.set_attribute(
                        cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        p as i32,
                    )
                    .map_err(Error::driver("tensor-core attention carveout"))?;
                }
            }
            funcs.push(f);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(Error::cublas("creating the cuBLAS handle"))?;
        tracing::debug!(
            pdl,
            ?fusion,
            norms_max_hidden,
            ?attn_splits,
            ?gemv_variant,
            gemv_max_ks,
            gemv_ks_exact,
            ?gemv_ks_shapes,
            gemv_tie,
            graph_steps,
            screen_head,
            fold_qkv,
            gemv_warps_per_sm,
            ?gemv_lanes,
            attn_tc_min_capacity,
            attn_tc_stages,
            attn_tc_early,
            attn_head_dim_kernels,
            attn_compact,
            ?early_trigger,
            ?half_prefetch,
            ?carveout,
            ?attn_tc_carveout,
            "kernels loaded"
        );
        Ok(Kernels {
            funcs,
            modules,
            stream,
            blas,
            dtype,
            gemv_table: GemvTable::new(),
            gemv_candidates: Default::default(),
            pdl,
            fuse_merge: fusion.split_merge,
            fuse_cluster: fusion.cluster,
            fuse_norms: fusion.norms,
            fuse_rope: fusion.rope,
            norms_max_hidden,
            attn_splits,
            gemv_variant,
            gemv_max_ks,
            gemv_ks_exact,
            gemv_ks_shapes,
            gemv_tie,
            graph_steps,
            screen_head,
            fold_qkv,
            gemv_warps_per_sm,
            gemv_lanes,
            attn_tc_min_capacity,
            attn_tc_stages,
            attn_tc_early,
            attn_tc_smem_max,
            attn_o_smem_max,
            fuse_o,
            attn_head_dim_kernels,
            attn_compact,
            early_trigger,
            half_prefetch,
            smem_optin: optin_bytes,
            marks: RefCell::new(None),
            last_merge: Cell::new("none"),
            gemv_log: RefCell::new(None),
            fuse_push: fusion.push,
        })
    }

    /// The split-K factor of a GEMV of `rows` outputs (`gateup`: the stacked gate|up, whose
    /// weight rows count both halves) by `cols` on `sms` multiprocessors: the split
    /// `FERRUM_GEMV_KS_SHAPES` names for the shape, else `plan::gemv_split_k_exact`'s.
    pub(crate) fn gemv_ks(&self, rows: usize, cols: usize, gateup: bool, sms: usize) -> u32 {
        let rows = crate::plan::gemv_weight_rows(rows, gateup);
        crate::plan::gemv_ks_shape(&self.gemv_ks_shapes, rows, cols).unwrap_or_else(|| {
            crate::plan::gemv_split_k_exact(
                rows,
                cols,
                sms,
                self.gemv_max_ks,
                self.gemv_warps_per_sm,
                self.gemv_ks_exact,
            )
        })
    }

    fn builder(&self, k: Kernel) -> Launch<'_> {
        // Kernel::ALL[i] == i-th variant and `funcs` was filled in that order.
        Launch {
            func: &self.funcs[k as usize],
            kernel: k,
            stream: &self.stream,
            args: [std::ptr::null_mut(); MAX_ARGS],
            n: 0,
            pdl: self.pdl,
            cluster_y: 0,
            marks: &self.marks,
        }
    }

    /// Whether the loaded kernels are the timeline build (`cargo xtask ptx --timeline`): every
    /// module has the stamp table (crate::timeline).
    pub(crate) fn has_timeline(&self) -> bool {
        self.modules.iter().all(|m| m.get_global("ferrum_tl_on", &self.stream).is_ok())
    }

    /// Timeline build: the kernels launched on the stream after this call stamp as replay
    /// `Some(r)` (`r == 0` resets every table first; at most `timeline::REPLAYS` replays between
    /// two reads) or not at all (`None`), in stream order, up to the next call.
    pub(crate) fn timeline_set(&self, replay: Option<u32>) -> Result<()> {
        let flag = match replay {
            Some(r) if r as usize >= crate::timeline::REPLAYS => {
                return Err(Error::InvalidArgument(format!(
                    "timeline replay {r}: at most {} replays between two reads",
                    crate::timeline::REPLAYS
                )))
            }
            Some(r) => r + 1,
            None => 0,
        };
        for m in &self.modules {
            if replay == Some(0) {
                let mut t = self.timeline_global(m, "ferrum_tl")?;
                let ones = vec![0xffu8; t.len()];
                self.stream.memcpy_htod(&ones, &mut t).map_err(Error::driver("resetting the timeline table"))?;
            }
            let mut f = self.timeline_global(m, "ferrum_tl_on")?;
            let bytes = flag.to_le_bytes();
            self.stream.memcpy_htod(&bytes[..f.len().min(4)], &mut f).map_err(Error::driver("the timeline flag"))?;
        }
        Ok(())
    }

    /// A timeline build's module global (`ferrum_tl` or `ferrum_tl_on`); an `InvalidArgument`
    /// error naming the build to make when the kernels are the plain ones.
    fn timeline_global<'a>(&'a self, m: &'a Arc<CudaModule>, name: &str) -> Result<CudaViewMut<'a, u8>> {
        m.get_global(name, &self.stream).map_err(|_| {
            Error::InvalidArgument(
                "the kernels are not the timeline build (build the PTX with `cargo xtask ptx --timeline`)".into(),
            )
        })
    }

    /// Timeline build: the stamps of every module, per replay row, each row sorted by grid id
    /// (waits for the stream first).
    pub(crate) fn timeline_read(&self) -> Result<Vec<Vec<crate::timeline::GridStamp>>> {
        let mut rows: Vec<Vec<crate::timeline::GridStamp>> = Vec::new();
        for m in &self.modules {
            let t = self.timeline_global(m, "ferrum_tl")?;
            let bytes = self.stream.clone_dtoh(&t).map_err(Error::driver("reading the timeline table"))?;
            let want = crate::timeline::REPLAYS * crate::timeline::NODES * crate::timeline::SLOT_BYTES;
            if bytes.len() != want {
                return Err(Error::InvalidArgument(format!(
                    "the timeline table holds {} bytes, this build reads {want}: rebuild the PTX with `cargo xtask ptx --timeline`",
                    bytes.len()
                )));
            }
            for (i, r) in crate::timeline::parse_table(&bytes).into_iter().enumerate() {
                if rows.len() <= i {
                    rows.resize_with(i + 1, Vec::new);
                }
                rows[i].extend(r);
            }
        }
        for r in &mut rows {
            r.sort_by_key(|s| s.grid);
        }
        Ok(rows)
    }

    /// `x[r][:] = table[tokens[r]][:]` for `rows` rows (ids >= vocab give zero rows).
    pub(crate) fn embed(
        &self,
        x: Region<'_, f32>,
        table: Region<'_, u16>,
        tokens: Region<'_, u32>,
        rows: usize,
        vocab: usize,
        hidden: usize,
    ) -> Result<()> {
        let px = x.need(rows * hidden, "embed x")?;
        let pt = table.need(vocab * hidden, "embed table")?;
        let ptok = tokens.need(rows, "embed tokens")?;
        let (vocab, hidden) = (i32_of(vocab, "vocab")?, i32_of(hidden, "hidden")?);
        let mut b = self.builder(pick(self.dtype, Kernel::EmbedF16, Kernel::EmbedBf16));
        b.arg(&px).arg(&pt).arg(&ptok).arg(&vocab).arg(&hidden);
        // SAFETY: the kernel writes x[0 .. rows*hidden), reads tokens[0 .. rows) and, for ids
        // below vocab only (it checks), table[0 .. vocab*hidden): all three extents were checked
        // above against regions that lie inside live allocations; the argument list matches
        // the kernel's signature (f32*, T*, u32*, int, int). Its 16-byte path (hidden % 8 == 0)
        // reads the table row as uint4 and writes x as float4 pairs: the table is a whole
        // weight allocation and x an activation buffer from its start (the decode step's and
        // the prefill's only call), both from cuMemAlloc (256-byte aligned), so every row
        // starts at a multiple of hidden elements, 16 bytes for the dtype and 32 for f32.
        unsafe { b.launch(cfg((grid1(rows)?, 1, 1), 256)) }.map_err(Error::driver("embed"))?;
        Ok(())
    }

    /// `y[r] = rmsnorm(x[r]) * w` for `rows` rows of `hidden` (x, y fp32; w in the dtype).
    pub(crate) fn rmsnorm(
        &self,
        y: Region<'_, f32>,
        x: Region<'_, f32>,
        w: Region<'_, u16>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let py = y.need(rows * hidden, "rmsnorm y")?;
        let px = x.need(rows * hidden, "rmsnorm x")?;
        let pw = w.need(hidden, "rmsnorm w")?;
        let h = i32_of(hidden, "hidden")?;
        let mut b = self.builder(pick(self.dtype, Kernel::RmsNormF16, Kernel::RmsNormBf16));
        b.arg(&py).arg(&px).arg(&pw).arg(&h).arg(&eps);
        // SAFETY: one block per row reads x and writes y at [r*hidden, (r+1)*hidden) for
        // r < rows, and reads w[0 .. hidden): extents checked above; signature
        // (f32*, const f32*, const T*, int, float) matches.
        unsafe { b.launch(cfg((grid1(rows)?, 1, 1), norm_block(hidden))) }.map_err(Error::driver("rmsnorm"))?;
        Ok(())
    }

    /// `x[r] += delta[r]; y[r] = rmsnorm(x[r]) * w` (x, delta, y fp32; w in the dtype).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rmsnorm(
        &self,
        x: Region<'_, f32>,
        delta: Region<'_, f32>,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let px = x.need(rows * hidden, "add_rmsnorm x")?;
        let pd = delta.need(rows * hidden, "add_rmsnorm delta")?;
        let py = y.need(rows * hidden, "add_rmsnorm y")?;
        let pw = w.need(hidden, "add_rmsnorm w")?;
        let h = i32_of(hidden, "hidden")?;
        let mut b = self.builder(pick(self.dtype, Kernel::AddRmsNormF16, Kernel::AddRmsNormBf16));
        b.arg(&px).arg(&pd).arg(&py).arg(&pw).arg(&h).arg(&eps);
        // SAFETY: as for rmsnorm, plus delta read over the same rows*hidden extent; all checked
        // above; signature (f32*, const f32*, f32*, const T*, int, float) matches.
        unsafe { b.launch(cfg((grid1(rows)?, 1, 1), norm_block(hidden))) }.map_err(Error::driver("add_rmsnorm"))?;
        Ok(())
    }

    /// A peer kernel's preconditions: a message of `n` floats fits `peer`'s slots, and this
    /// runner's stream is on the rank's device.
    fn check_peer(&self, peer: &super::peer::PeerRank, n: usize, what: &str) -> Result<()> {
        if n > peer.capacity() {
            return Err(Error::Internal(format!("{what} of {n} floats, capacity {}", peer.capacity())));
        }
        peer.check_stream(&self.stream)
    }

    /// One row: `delta` summed over the ranks of `peer`'s group, then as
    /// [`add_rmsnorm`](Self::add_rmsnorm) — the peer all-reduce and the norm in one kernel
    /// (bit-identical to the all-reduce followed by `add_rmsnorm`). Up to
    /// `4 * norm_block(hidden)` values (hidden <= 1024, 2048 or 4096) the sums stay in
    /// registers and `delta` is left as it was; other rows sum it in place. The kernel reads
    /// `x` before its programmatic-launch wait, so the kernel launched just before it must not
    /// write `x` (the decode step: the o or down projection, which writes `delta`). With
    /// `pushed` the `_push` GEMV before it pushed delta's lines ([`Self::gemv_push`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn peer_add_rmsnorm(
        &self,
        peer: &super::peer::PeerRank,
        x: Region<'_, f32>,
        delta: Region<'_, f32>,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        hidden: usize,
        eps: f32,
        pushed: bool,
    ) -> Result<()> {
        self.check_peer(peer, hidden, "peer add_rmsnorm")?;
        let px = x.need(hidden, "peer_add_rmsnorm x")?;
        let pd = delta.need(hidden, "peer_add_rmsnorm delta")?;
        let py = y.need(hidden, "peer_add_rmsnorm y")?;
        let pw = w.need(hidden, "peer_add_rmsnorm w")?;
        let h = i32_of(hidden, "hidden")?;
        let args = peer.args();
        let kernel = if pushed {
            pick(self.dtype, Kernel::PeerAddRmsNormPushedF16, Kernel::PeerAddRmsNormPushedBf16)
        } else {
            pick(self.dtype, Kernel::PeerAddRmsNormF16, Kernel::PeerAddRmsNormBf16)
        };
        let mut b = self.builder(kernel);
        b.arg(args).arg(&px).arg(&pd).arg(&py).arg(&pw).arg(&h).arg(&eps);
        // With `pushed` (the `_pushed` kernel, same signature) the caller's `_push` GEMV wrote
        // delta and pushed its lines for this call (`gemv_push`).
        // SAFETY: signature (PeerArgs, f32*, f32*, f32*, const T*, int, float) matches; x,
        // delta, y hold `hidden` floats and w `hidden` weights (checked above); x's early read
        // is ordered after its last write by the caller's contract (doc above); the peer
        // buffers hold `capacity >= hidden` floats per slot and outlive the kernel (the group's
        // buffers are freed only after every device synchronised); the stream is on the peer
        // rank's device (checked), whose peer mappings the group enabled.
        unsafe { b.launch(cfg((1, 1, 1), norm_block(hidden))) }.map_err(Error::driver("peer_add_rmsnorm"))?;
        Ok(())
    }

    /// Bias, q/k norm, RoPE on the fp32 q|k|v rows (q in place, fp32) and the K/V append to
    /// one layer's cache (`[kv_heads][capacity][head_dim]`, in the dtype) at positions
    /// `pos[0] + t`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_qkv(
        &self,
        qkv: Region<'_, f32>,
        bias: Region<'_, u16>,
        q_norm: Region<'_, u16>,
        k_norm: Region<'_, u16>,
        k_cache: Region<'_, u16>,
        v_cache: Region<'_, u16>,
        inv_freq: Region<'_, f32>,
        pos: Region<'_, u32>,
        n_tok: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        eps: f32,
    ) -> Result<()> {
        let row = (heads + 2 * kv_heads) * head_dim;
        let p_qkv = qkv.need(n_tok * row, "rope qkv")?;
        let p_bias = bias.opt(row, "rope bias")?;
        let p_qn = q_norm.opt(head_dim, "rope q_norm")?;
        let p_kn = k_norm.opt(head_dim, "rope k_norm")?;
        let p_kc = k_cache.need(kv_heads * capacity * head_dim, "rope k cache")?;
        let p_vc = v_cache.need(kv_heads * capacity * head_dim, "rope v cache")?;
        let p_f = inv_freq.need(head_dim / 2, "rope inv_freq")?;
        let p_pos = pos.need(1, "rope pos")?;
        let (h, kvh, hd, cap) = (
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(capacity, "capacity")?,
        );
        let block = (head_dim / 2).div_ceil(32) as u32 * 32;
        let mut b = self.builder(pick(self.dtype, Kernel::RopeQkvF16, Kernel::RopeQkvBf16));
        b.arg(&p_qkv).arg(&p_bias).arg(&p_qn).arg(&p_kn).arg(&p_kc).arg(&p_vc).arg(&p_f).arg(&p_pos);
        b.arg(&h).arg(&kvh).arg(&hd).arg(&cap).arg(&eps);
        // SAFETY: blocks (head, t) touch the f32 qkv[t*row + head*hd .. +hd) for t < n_tok, bias
        // over one row (when non-null), the norms over head_dim, inv_freq over head_dim/2,
        // pos[0]; cache writes land at [kvh][pos][0..hd) only when pos < capacity (the kernel
        // checks, and the caller validated positions). Extents checked above; signature
        // (f32*, const T*, const T*, const T*, T*, T*, const f32*, const u32*, int x4, float)
        // matches.
        unsafe { b.launch(cfg(((heads + 2 * kv_heads) as u32, grid1(n_tok)?, 1), block)) }
            .map_err(Error::driver("rope_qkv"))?;
        Ok(())
    }

    /// Attention of `n_tok` query rows (row stride `q_stride`) over one layer's cache. With
    /// `n_splits == 1` writes `out` directly; else the splits' partials are merged into `out`:
    /// with `cluster` by the split blocks of each (token, head), launched as one thread-block
    /// cluster, through distributed shared memory (`plan::attn_cluster` must allow it); else
    /// through `part_acc` / `part_ml` by the last split block of each (token, head) when
    /// `counters` is not null, and by [`Self::attn_combine`] otherwise. With `rope` (one decode
    /// token only) `q` is the raw qkv row and the kernel also does [`Self::rope_qkv`]'s work,
    /// appending the new K/V row to the caches (`ferrum_attn_rope_*`, bit-identical to the two
    /// launches, except the compact kernel's case, which sums in another order:
    /// `attn_compact`). With `o` as well (and `cluster`: the other paths are refused), the
    /// kernel also adds the o projection to the residual (`ferrum_attn_rope[_early]_o_hd64_*`,
    /// which ignore their head-dim argument: `plan::attn_o_fits` must allow it, which admits
    /// head dim 64 only).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn(
        &self,
        rope: Option<AttnRope<'_>>,
        o: Option<AttnO<'_>>,
        q: Region<'_, f32>,
        q_stride: usize,
        k_cache: Region<'_, u16>,
        v_cache: Region<'_, u16>,
        out: Region<'_, f32>,
        part_acc: Region<'_, f32>,
        part_ml: Region<'_, f32>,
        counters: Region<'_, u32>,
        pos: Region<'_, u32>,
        n_tok: usize,
        n_splits: usize,
        warps: u32,
        cluster: bool,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<()> {
        if cluster && !crate::plan::attn_cluster(n_splits, self.pdl) {
            return Err(Error::Internal(format!("attn: a cluster merge of {n_splits} splits (pdl {})", self.pdl)));
        }
        if !crate::spec::SUPPORTED_HEAD_DIMS.contains(&head_dim) || warps == 0 || warps > ATTN_MAX_WARPS {
            return Err(Error::Internal(format!("attn: head_dim {head_dim}, warps {warps}")));
        }
        if q_stride < heads * head_dim {
            return Err(Error::Internal("attn: q stride".into()));
        }
        if n_tok == 0 {
            return Err(Error::Internal("attn: no tokens".into()));
        }
        // The split merge keeps one weight per split in shared memory (ATTN_MAX_SPLITS).
        if n_splits == 0 || n_splits > crate::plan::MAX_SPLITS {
            return Err(Error::Internal(format!("attn: {n_splits} splits")));
        }
        let pq = q.need((n_tok - 1) * q_stride + heads * head_dim, "attn q")?;
        let pk = k_cache.need(kv_heads * capacity * head_dim, "attn k cache")?;
        let pv = v_cache.need(kv_heads * capacity * head_dim, "attn v cache")?;
        // With several splits and non-null `counters` (or `cluster`), the split blocks merge the
        // partials into `out` themselves (zeroed counters, reset after each use).
        let (po, pa, pm, pc) = if n_splits == 1 {
            (out.need(n_tok * heads * head_dim, "attn out")?, 0u64, 0u64, 0u64)
        } else {
            let pc = counters.opt(n_tok * heads, "attn counters")?;
            (
                if pc == 0 && !cluster { 0u64 } else { out.need(n_tok * heads * head_dim, "attn out")? },
                part_acc.need(n_tok * heads * n_splits * head_dim, "attn part_acc")?,
                part_ml.need(n_tok * heads * n_splits * 2, "attn part_ml")?,
                pc,
            )
        };
        let ppos = pos.need(1, "attn pos")?;
        let rope_args = match &rope {
            None => None,
            Some(r) => {
                // The fused kernel reads the whole raw row (q, k and v heads), one token, and
                // one thread per rotation pair.
                let row = (heads + 2 * kv_heads) * head_dim;
                if n_tok != 1 || q_stride != row || (warps as usize) * 32 < head_dim / 2 {
                    return Err(Error::Internal(format!(
                        "attn with rope: {n_tok} tokens, stride {q_stride} (row {row}), {warps} warps"
                    )));
                }
                q.need(row, "attn rope qkv")?;
                Some((
                    r.bias.opt(row, "attn rope bias")?,
                    r.q_norm.opt(head_dim, "attn rope q_norm")?,
                    r.k_norm.opt(head_dim, "attn rope k_norm")?,
                    r.inv_freq.need(head_dim / 2, "attn rope inv_freq")?,
                    r.eps,
                    // The folded residual: null, or a non-empty region whose length is pre_n.
                    r.pre.opt(r.pre.len.max(1), "attn folded residual")?,
                    i32_of(r.pre.len, "folded residual")?,
                ))
            }
        };
        let early = rope.as_ref().is_some_and(|r| r.early);
        // The compact kernel (attention.cu's attn_compact_hd64): its case exactly, checked
        // here in full, since the kernel has no other path; it loads the raw row as float4 and
        // the cache rows as 16-byte chunks, so those start 16-byte aligned.
        let compact = self.attn_compact
            && o.is_none()
            && [pq, pk, pv].iter().all(|p| p % 16 == 0)
            // no bias, q_norm or k_norm (null pointers), no folded residual (pre_n == 0)
            && rope_args.as_ref().is_some_and(|r| r.0 == 0 && r.1 == 0 && r.2 == 0 && r.6 == 0)
            && crate::plan::attn_compact_fits(head_dim, n_tok, warps, early, cluster, n_splits, capacity);
        let dyn_bytes = if compact {
            crate::plan::attn_compact_dyn_bytes(n_splits)
        } else {
            crate::plan::attn_dyn_bytes(warps, early, cluster, n_splits, head_dim)
        };
        let o_args = match &o {
            None => None,
            Some(o) => {
                // One token with the RoPE fusion (checked above for `rope`), and the splits of
                // each head in one cluster (which shares the head's o-projection rows).
                if rope_args.is_none() || !cluster {
                    return Err(Error::Internal(format!(
                        "attn with o: rope {}, {n_splits} splits, cluster {cluster}",
                        rope_args.is_some()
                    )));
                }
                if !crate::plan::attn_o_fits(dyn_bytes, o.hidden, head_dim, n_splits, self.attn_o_smem_max) {
                    return Err(Error::Internal(format!(
                        "attn with o: hidden {} at head dim {head_dim} past the shared memory allowance",
                        o.hidden
                    )));
                }
                Some((
                    o.wo.need(o.hidden * heads * head_dim, "attn o weights")?,
                    o.x.need(o.hidden, "attn o residual")?,
                    o.part.need(heads * o.hidden, "attn o partials")?,
                    o.ticket.need(crate::plan::ATTN_MAX_CLUSTER, "attn o tickets")?,
                    i32_of(o.hidden, "hidden")?,
                ))
            }
        };
        let qs = i32_of(q_stride, "q_stride")?;
        let (h, kvh, hd, cap) = (
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(capacity, "capacity")?,
        );
        let scale = 1.0f32 / (head_dim as f32).sqrt();
        // The fused kernels of head dim 128 have their own instance (plan::ATTN_OWN_HEAD_DIMS;
        // the same signature, the head dim passed and ignored).
        let own =
            (self.attn_head_dim_kernels && crate::plan::ATTN_OWN_HEAD_DIMS.contains(&head_dim)).then_some(head_dim);
        let fold = rope_args.as_ref().is_some_and(|r| r.5 != 0);
        if fold && (o_args.is_some() || !crate::plan::FOLD_HEAD_DIMS.contains(&head_dim)) {
            return Err(Error::Internal(format!(
                "attn: a folded q/k/v with o {}, head dim {head_dim}",
                o_args.is_some()
            )));
        }
        let kernel = match (rope_args.is_some(), early, own) {
            _ if compact => pick(self.dtype, Kernel::AttnRopeEarlyCompactHd64F16, Kernel::AttnRopeEarlyCompactHd64Bf16),
            (true, true, _) if fold && head_dim == 64 => {
                pick(self.dtype, Kernel::AttnRopeEarlyFoldHd64F16, Kernel::AttnRopeEarlyFoldHd64Bf16)
            }
            (true, false, _) if fold && head_dim == 64 => {
                pick(self.dtype, Kernel::AttnRopeFoldHd64F16, Kernel::AttnRopeFoldHd64Bf16)
            }
            (true, true, _) if fold => {
                pick(self.dtype, Kernel::AttnRopeEarlyFoldHd128F16, Kernel::AttnRopeEarlyFoldHd128Bf16)
            }
            (true, false, _) if fold => pick(self.dtype, Kernel::AttnRopeFoldHd128F16, Kernel::AttnRopeFoldHd128Bf16),
            // (attn_o_fits, checked above, admits plan::ATTN_O_HEAD_DIMS = [64] only)
            (true, true, _) if o_args.is_some() => {
                pick(self.dtype, Kernel::AttnRopeEarlyOHd64F16, Kernel::AttnRopeEarlyOHd64Bf16)
            }
            (true, false, _) if o_args.is_some() => {
                pick(self.dtype, Kernel::AttnRopeOHd64F16, Kernel::AttnRopeOHd64Bf16)
            }
            (false, _, _) => pick(self.dtype, Kernel::AttnF16, Kernel::AttnBf16),
            (true, true, None) => pick(self.dtype, Kernel::AttnRopeEarlyF16, Kernel::AttnRopeEarlyBf16),
            (true, false, None) => pick(self.dtype, Kernel::AttnRopeF16, Kernel::AttnRopeBf16),
            (true, true, Some(128)) => pick(self.dtype, Kernel::AttnRopeEarlyHd128F16, Kernel::AttnRopeEarlyHd128Bf16),
            (true, false, Some(128)) => pick(self.dtype, Kernel::AttnRopeHd128F16, Kernel::AttnRopeHd128Bf16),
            (true, _, Some(hd)) => return Err(Error::Internal(format!("attn: no own kernel for head dim {hd}"))),
        };
        let mut b = self.builder(kernel);
        b.arg(&pq).arg(&qs).arg(&pk).arg(&pv).arg(&po).arg(&pa).arg(&pm).arg(&pc).arg(&ppos);
        b.arg(&h).arg(&kvh).arg(&hd).arg(&cap).arg(&scale);
        if let Some((bias, qn, kn, freq, eps, pre, pre_n)) = &rope_args {
            b.arg(bias).arg(qn).arg(kn).arg(freq).arg(eps);
            // Only the `_fold` kernels take the folded residual (checked above).
            if fold {
                b.arg(pre).arg(pre_n);
            }
        }
        if let Some((wo, x, part, ticket, hidden)) = &o_args {
            b.arg(wo).arg(x).arg(part).arg(ticket).arg(hidden);
        }
        let grid = (heads as u32, grid1(n_splits)?, grid1(n_tok)?);
        let mut c = cfg(grid, 32 * warps);
        c.shared_mem_bytes = dyn_bytes + o.map_or(0, |o| crate::plan::attn_o_bytes(o.hidden, head_dim, n_splits));
        if cluster {
            b.cluster_y(grid.1);
        }
        // SAFETY: block (h, s, t) reads the f32 q[t*q_stride + h*hd .. +hd) and cache rows
        // [kvh][0 .. min(pos+t+1, capacity)) (the kernel clamps to capacity), and writes
        // either the f32 out[t][h*hd .. +hd) (one split) or partials at
        // ((t*heads + h)*n_splits + s); with counters, it increments counters[t*heads + h] and
        // the last block of (t, h) reads those partials and writes out[t][h*hd .. +hd)
        // (n_splits <= MAX_SPLITS, the size of the merge's shared weight arrays); with
        // `cluster` (2..=ATTN_MAX_CLUSTER splits, the compute_90 kernels: checked above) the
        // blocks of each (h, t) form one cluster of n_splits blocks along y, each writes its
        // partial into the merge buffer of the cluster's first block (attn_merge_bytes at the
        // start of the dynamic shared memory, which attn_dyn_bytes includes; the kernel checks
        // %dynamic_smem_size) and that block writes out[t][h*hd .. +hd); all
        // extents checked above; the unused outputs are null and never touched; signature
        // (const f32*, int, const T*, const T*, f32*, f32*, f32*, u32*, const u32*, int x4,
        // float) matches. With rope (one token, q the whole raw row, checked above) the kernel
        // also reads bias over one row and the norms over head_dim when non-null, inv_freq over
        // head_dim/2, and for each KV head one block (the first query head of the group, in
        // the split holding position pos < capacity; the kernel checks) writes cache row
        // [kvh][pos][0..hd) in both caches, a row no block of the launch reads; there the
        // caches are T* (same ABI) and the extra parameters (const T* x3, const f32*, float)
        // follow in that order (the `_hd128` kernels, launched for head dim 128 only, have the
        // same signature). The early copies (rope with `early`: the `_early` kernel, same
        // signature) write only the launch's dynamic shared memory, 2 * ATTN_EARLY_ROWS
        // 16-byte chunks per thread after the merge buffer, which is what attn_dyn_bytes gives,
        // within the attn_max_dyn_bytes the kernels were allowed at load (the kernel checks
        // %dynamic_smem_size before using it). The fused kernels read pos[0] and (`_early`)
        // cache rows below pos before their programmatic-launch wait: those were written by
        // kernels that have completed by then (attention.cu gives the argument), and the
        // extents are the ones checked above. With `o` (the `_o` kernels: one token, rope and
        // the cluster, checked above; the extra parameters (const T*, f32*, f32*, u32*, int)
        // follow the rope ones), block j of head h's cluster reads wo's columns h*hd .. +hd of
        // its rows [j*R, (j+1)*R) ∩ [0, hidden) (R = attn_o_rows; hidden * heads * hd checked),
        // copies them to the end of its dynamic shared memory (attn_o_bytes, added above,
        // within the attn_o_smem_max allowance set at load: attn_o_fits checked), receives
        // block 0's merged row in its own static shared memory (st.async within the cluster),
        // writes part[h][those rows] and increments ticket[j] (j < n_splits <=
        // ATTN_MAX_CLUSTER); the last of the `heads` blocks of row range j reads part[*][its
        // rows] and reads and writes x[its rows] (extents checked above). With a non-null
        // `pre` (the folded q/k/v: the `_fold_hd64` / `_fold_hd128` kernels, launched for those
        // head dims only and never with `o`, checked above; same signature as the rope kernels
        // plus (const f32*, int) after eps), every block reads pre[0 .. pre_n), pre_n being
        // the region's own length, at least 1 (checked above). The compact kernel (`compact`:
        // the `_early` signature; one token, head dim 64, 4 warps, the cluster, no bias, norms
        // or fold, splits of at most plan::ATTN_COMPACT_ROWS rows, all checked above) reads the
        // raw row, pos[0], inv_freq and cache rows [kvh][split's rows] below min(pos + 1,
        // capacity), with 16-byte loads from 16-byte aligned bases (checked above), writes
        // cache row [kvh][pos] (pos < capacity only) and out[h*64 .. +64); its merge buffer
        // and early copies fill attn_compact_dyn_bytes (within attn_max_dyn_bytes; the kernel
        // checks %dynamic_smem_size and the launch shape, n_splits <= ATTN_MAX_CLUSTER
        // included), and every warp's st.async writes only its own partial's 272 bytes of
        // block 0's merge buffer, block 0 alive until the mbarrier has counted them all.
        unsafe { b.launch(c) }.map_err(Error::driver("attn"))?;
        Ok(())
    }

    /// Causal attention of `n_tok` query rows (row stride `q_stride`, the first at position
    /// `pos[0]`) over one layer's cache on tensor cores (attention.cu's
    /// `ferrum_attn_prefill_*`): `out` `[n_tok][heads*head_dim]` f32. Head dims in
    /// `plan::PREFILL_HEAD_DIMS` (the kernel's switch; any other is refused here).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_prefill(
        &self,
        q: Region<'_, f32>,
        q_stride: usize,
        k_cache: Region<'_, u16>,
        v_cache: Region<'_, u16>,
        out: Region<'_, f32>,
        pos: Region<'_, u32>,
        n_tok: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<()> {
        if !crate::plan::PREFILL_HEAD_DIMS.contains(&head_dim) || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::Internal(format!("attn_prefill: head_dim {head_dim}, heads {heads}/{kv_heads}")));
        }
        if n_tok == 0 || q_stride < heads * head_dim {
            return Err(Error::Internal(format!("attn_prefill: {n_tok} tokens, q stride {q_stride}")));
        }
        let pq = q.need((n_tok - 1) * q_stride + heads * head_dim, "attn_prefill q")?;
        let pk = k_cache.need(kv_heads * capacity * head_dim, "attn_prefill k cache")?;
        let pv = v_cache.need(kv_heads * capacity * head_dim, "attn_prefill v cache")?;
        let po = out.need(n_tok * heads * head_dim, "attn_prefill out")?;
        let ppos = pos.need(1, "attn_prefill pos")?;
        let (qs, nt, h, kvh, hd, cap) = (
            i32_of(q_stride, "q_stride")?,
            i32_of(n_tok, "n_tok")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(capacity, "capacity")?,
        );
        let scale = 1.0f32 / (head_dim as f32).sqrt();
        let mut b = self.builder(pick(self.dtype, Kernel::AttnPrefillF16, Kernel::AttnPrefillBf16));
        b.arg(&pq)
            .arg(&qs)
            .arg(&pk)
            .arg(&pv)
            .arg(&po)
            .arg(&ppos)
            .arg(&nt)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&cap)
            .arg(&scale);
        let grid = (heads as u32, grid1(n_tok.div_ceil(PREFILL_ROWS_PER_BLOCK))?, 1);
        // SAFETY: block (h, y) takes the query rows t = R*b .. R*b + R - 1 with b = gridDim.y - 1
        // - y and R = PREFILL_ROWS_PER_BLOCK; it reads the f32 q rows t < n_tok at t*q_stride +
        // h*hd .. +hd (8-byte loads: q_stride, h*hd and the column are even), pos[0], and cache
        // rows [kvh][0 .. min(pos[0] + t_last + 1, capacity)) with 16-byte cp.async copies (cache
        // regions start at multiples of head_dim elements of a 256-byte-aligned allocation,
        // head_dim % 16 == 0; rows past that end are zero-filled, reading nothing); it writes
        // the f32 out[t][h*hd .. +hd) for t < n_tok only. Extents checked above; blocks of
        // PREFILL_THREADS threads (PREFILL_WARPS warps of 16 query rows, as the kernel's
        // PF_WARPS and PF_BM; a unit test compares the constants); static shared memory only;
        // signature (const f32*, int, const T*, const T*, f32*, const u32*, int x6, float)
        // matches.
        unsafe { b.launch(cfg(grid, PREFILL_THREADS)) }.map_err(Error::driver("attn_prefill"))?;
        Ok(())
    }

    /// Decode attention of one token per launch row (`n_tok` rows of q, row stride `q_stride`,
    /// roped) over one layer's cache on tensor cores (attention.cu's `ferrum_attn_gqa_*`), the
    /// q heads of each KV group as the rows of one tile: `out` `[n_tok][heads*head_dim]` f32
    /// with one split, else the partials for [`attn_combine`](Self::attn_combine). Shapes
    /// outside `plan::attn_tensor_core` are refused. Launch it right after the rope_qkv that
    /// writes this step's cache rows and q: it reads `pos` and the older cache rows before its
    /// programmatic-launch wait, which is safe only when the kernel it depends on writes
    /// neither.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_gqa(
        &self,
        q: Region<'_, f32>,
        q_stride: usize,
        k_cache: Region<'_, u16>,
        v_cache: Region<'_, u16>,
        out: Region<'_, f32>,
        part_acc: Region<'_, f32>,
        part_ml: Region<'_, f32>,
        pos: Region<'_, u32>,
        n_tok: usize,
        n_splits: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<()> {
        if !crate::plan::attn_tensor_core(head_dim, heads, kv_heads, capacity, 0) {
            return Err(Error::Internal(format!("attn_gqa: head_dim {head_dim}, heads {heads}/{kv_heads}")));
        }
        if n_tok == 0 || q_stride < heads * head_dim || n_splits == 0 || n_splits > crate::plan::MAX_SPLITS {
            return Err(Error::Internal(format!("attn_gqa: {n_tok} tokens, q stride {q_stride}, {n_splits} splits")));
        }
        let pq = q.need((n_tok - 1) * q_stride + heads * head_dim, "attn_gqa q")?;
        let pk = k_cache.need(kv_heads * capacity * head_dim, "attn_gqa k cache")?;
        let pv = v_cache.need(kv_heads * capacity * head_dim, "attn_gqa v cache")?;
        let (po, pa, pm) = if n_splits == 1 {
            (out.need(n_tok * heads * head_dim, "attn_gqa out")?, 0u64, 0u64)
        } else {
            (
                0u64,
                part_acc.need(n_tok * heads * n_splits * head_dim, "attn_gqa part_acc")?,
                part_ml.need(n_tok * heads * n_splits * 2, "attn_gqa part_ml")?,
            )
        };
        let ppos = pos.need(1, "attn_gqa pos")?;
        let (qs, h, kvh, hd, cap) = (
            i32_of(q_stride, "q_stride")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(capacity, "capacity")?,
        );
        let scale = 1.0f32 / (head_dim as f32).sqrt();
        // The configured stage count, or fewer where this GPU's blocks cannot hold it.
        let n_stages = crate::plan::attn_tc_stages_fitting(self.attn_tc_stages, head_dim, self.attn_tc_smem_max);
        let stages = i32_of(n_stages, "stages")?;
        let early = i32::from(self.attn_tc_early);
        let mut b = self.builder(pick(self.dtype, Kernel::AttnGqaF16, Kernel::AttnGqaBf16));
        b.arg(&pq)
            .arg(&qs)
            .arg(&pk)
            .arg(&pv)
            .arg(&po)
            .arg(&pa)
            .arg(&pm)
            .arg(&ppos)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&cap)
            .arg(&scale)
            .arg(&stages)
            .arg(&early);
        let grid = (kv_heads as u32, n_splits as u32, grid1(n_tok)?);
        let mut c = cfg(grid, 32);
        c.shared_mem_bytes = crate::plan::attn_gqa_dyn_bytes(n_stages, head_dim);
        // SAFETY: block (g, s, t) reads pos[0], the f32 q row t at t*q_stride + h*hd .. +hd
        // (8-byte loads: q_stride, h*hd and the column are even) for the group's heads h =
        // g*G .. g*G + G - 1 (G = heads / kv_heads <= 16, checked above), and cache rows
        // [g][s*chunk .. min((s+1)*chunk, len)) with len = min(pos[0] + t + 1, capacity), by
        // 16-byte cp.async copies (cache regions start at multiples of head_dim elements of a
        // 256-byte-aligned allocation, head_dim % 16 == 0; tile rows past the split are
        // zero-filled, reading nothing). With one split it writes out[t][h*hd .. +hd), else
        // part_acc[(t*heads + h)*n_splits + s][..hd] and part_ml[..][0..2] (a null pointer is
        // never written: each pointer is read only on its own branch of n_splits == 1).
        // Before its programmatic-launch wait the kernel reads pos[0] (an L2 load) and, with
        // `early`, cache rows below pos[0]: the kernel it depends on (rope_qkv) writes
        // neither (it writes rows pos[0] .. pos[0] + n_tok - 1 and q), and the earlier writers
        // completed before this grid started (rope_qkv waits before it lets its dependent
        // launch: common.cuh). Extents checked above; one warp per block; dynamic shared memory
        // for `n_stages` tiles of this head dim (2..=6, fitted to attn_tc_smem_max, which the
        // load set as the kernel's allowance); signature (const f32*, int, const T*, const T*,
        // f32*, f32*, f32*, const u32*, int x4, float, int, int) matches.
        unsafe { b.launch(c) }.map_err(Error::driver("attn_gqa"))?;
        Ok(())
    }

    /// Merges `n_splits` attention partials into `out` `[n_tok][heads*head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_combine(
        &self,
        out: Region<'_, f32>,
        part_acc: Region<'_, f32>,
        part_ml: Region<'_, f32>,
        n_tok: usize,
        n_splits: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        // The merge keeps one weight per split in shared memory (ATTN_MAX_SPLITS).
        if n_splits == 0 || n_splits > crate::plan::MAX_SPLITS {
            return Err(Error::Internal(format!("attn_combine: {n_splits} splits")));
        }
        let po = out.need(n_tok * heads * head_dim, "combine out")?;
        let pa = part_acc.need(n_tok * heads * n_splits * head_dim, "combine part_acc")?;
        let pm = part_ml.need(n_tok * heads * n_splits * 2, "combine part_ml")?;
        let (h, hd, ns) = (i32_of(heads, "heads")?, i32_of(head_dim, "head_dim")?, i32_of(n_splits, "n_splits")?);
        let mut b = self.builder(pick(self.dtype, Kernel::AttnCombineF16, Kernel::AttnCombineBf16));
        b.arg(&po).arg(&pa).arg(&pm).arg(&h).arg(&hd).arg(&ns);
        let block = head_dim.div_ceil(32) as u32 * 32;
        // SAFETY: block (h, t) thread d < hd reads partials ((t*heads + h)*n_splits + s) for
        // s < n_splits and writes the f32 out[t][h*hd + d]; extents checked above, and
        // n_splits <= MAX_SPLITS, the size of the merge's shared weight arrays.
        unsafe { b.launch(cfg((heads as u32, grid1(n_tok)?, 1), block)) }.map_err(Error::driver("attn_combine"))?;
        Ok(())
    }

    /// Adds a GEMV launch's shape to `gemv_log` while a device-fed step is encoded.
    fn log_gemv(&self, key: super::GemvKey) {
        if let Some(log) = self.gemv_log.borrow_mut().as_mut() {
            log.insert(key);
        }
    }

    /// `y = W x` (batch 1) with ferrum's GEMV: W (`rows x cols`) in the dtype, x and y fp32.
    /// W must be complete before the launch and never written by a later kernel: the GEMVs
    /// read it before their programmatic-launch wait (gemv.cu, `ldg_early`).
    pub(crate) fn gemv(
        &self,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.gemv_io(y, w, x, rows, cols, GemvIo::Plain)
    }

    /// [`gemv`](Self::gemv) with a fusion on its input or output (see [`GemvIo`]).
    pub(crate) fn gemv_io(
        &self,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        rows: usize,
        cols: usize,
        io: GemvIo<'_>,
    ) -> Result<()> {
        self.gemv_as(y, w, x, rows, cols, io, rows)
    }

    /// The variant and the lanes a row group of the plain / `_norm` GEMV of an `as_rows x cols`
    /// matrix (with `lanes < 32`, the short-row kernels): together they fix each row's
    /// summation order, which the screened head's exact rows repeat.
    fn gemv_order(&self, as_rows: usize, cols: usize) -> Result<(GemvVariant, u32)> {
        let v = self.gemv_table.get(&(as_rows, cols, false)).copied().unwrap_or_default();
        // A tall matrix of short rows without split-K (small models' LM heads): 8 or 16 lanes
        // per two-row group (the plain and `_norm` kernels; two rows per group whatever the
        // variant's `rows4`). Chosen from the whole matrix's shape (`as_rows`), as the variant.
        let lanes = crate::plan::gemv_lanes_per_row(as_rows, cols, v.ks, self.gemv_lanes);
        if lanes < 32 && v.ks != 1 {
            // plan::gemv_lanes_per_row never gives it: the short-row kernels have no split-K sum.
            return Err(Error::Internal(format!("a {lanes}-lane GEMV with split-K {}", v.ks)));
        }
        Ok((v, lanes))
    }

    /// [`gemv_io`](Self::gemv_io) of some rows of a taller matrix, launched as the matrix's
    /// own GEMV (`as_rows` rows, `cols` columns) is: the same variant and split-K factor, so
    /// every row's dot product rounds exactly as in the whole product (a TP rank's LM head
    /// rows under the vocab split).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_as(
        &self,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        rows: usize,
        cols: usize,
        io: GemvIo<'_>,
        as_rows: usize,
    ) -> Result<()> {
        let py = y.need(rows, "gemv y")?;
        let pw = w.need(rows * cols, "gemv W")?;
        let px = x.need(cols, "gemv x")?;
        let (pn, eps) = match io {
            GemvIo::Norm { w, eps } => (w.need(cols, "gemv norm weight")?, eps),
            GemvIo::Plain | GemvIo::AddTo { .. } => (0u64, 0.0f32),
        };
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let (v, lanes) = self.gemv_order(as_rows, cols)?;
        self.log_gemv((as_rows, cols, false));
        let short = match (lanes, io) {
            (8, GemvIo::Plain) => Some(pick(self.dtype, Kernel::GemvL8F16, Kernel::GemvL8Bf16)),
            (8, GemvIo::Norm { .. }) => Some(pick(self.dtype, Kernel::GemvNormL8F16, Kernel::GemvNormL8Bf16)),
            (16, GemvIo::Plain) => Some(pick(self.dtype, Kernel::GemvL16F16, Kernel::GemvL16Bf16)),
            (16, GemvIo::Norm { .. }) => Some(pick(self.dtype, Kernel::GemvNormL16F16, Kernel::GemvNormL16Bf16)),
            _ => None,
        };
        let k = short.unwrap_or(match (v.rows4, io) {
            (false, GemvIo::Plain) => pick(self.dtype, Kernel::GemvF16, Kernel::GemvBf16),
            (true, GemvIo::Plain) => pick(self.dtype, Kernel::Gemv4F16, Kernel::Gemv4Bf16),
            (false, GemvIo::Norm { .. }) if self.half_prefetch.norm => {
                pick(self.dtype, Kernel::GemvNormPfhF16, Kernel::GemvNormPfhBf16)
            }
            (true, GemvIo::Norm { .. }) if self.half_prefetch.norm => {
                pick(self.dtype, Kernel::Gemv4NormPfhF16, Kernel::Gemv4NormPfhBf16)
            }
            (false, GemvIo::Norm { .. }) => pick(self.dtype, Kernel::GemvNormF16, Kernel::GemvNormBf16),
            (true, GemvIo::Norm { .. }) => pick(self.dtype, Kernel::Gemv4NormF16, Kernel::Gemv4NormBf16),
            (false, GemvIo::AddTo { early_trigger: false }) => {
                pick(self.dtype, Kernel::GemvResF16, Kernel::GemvResBf16)
            }
            (true, GemvIo::AddTo { early_trigger: false }) => {
                pick(self.dtype, Kernel::Gemv4ResF16, Kernel::Gemv4ResBf16)
            }
            (false, GemvIo::AddTo { early_trigger: true }) if self.half_prefetch.res => {
                pick(self.dtype, Kernel::GemvResEtPfhF16, Kernel::GemvResEtPfhBf16)
            }
            (false, GemvIo::AddTo { early_trigger: true }) => {
                pick(self.dtype, Kernel::GemvResEtF16, Kernel::GemvResEtBf16)
            }
            (true, GemvIo::AddTo { early_trigger: true }) => {
                pick(self.dtype, Kernel::Gemv4ResEtF16, Kernel::Gemv4ResEtBf16)
            }
        });
        let mut b = self.builder(k);
        b.arg(&py).arg(&pw).arg(&px).arg(&r).arg(&c).arg(&pn).arg(&eps);
        let grid = if short.is_some() { v.grid_lanes(rows, lanes)? } else { v.grid(rows, false)? };
        // SAFETY: each group of ks warps (block (32 * groups, ks), groups * ks <= 8 as
        // gemv.cu's shared slots assume: `GemvVariant::block_dim`) reads ROWS (2 or 4)
        // consecutive rows of W (clamped to rows-1) over cols, each warp its column stripes
        // (the short-row kernels: each 8 or 16 lanes of a warp two rows, with ks == 1 as
        // plan::gemv_lanes_per_row guarantees, the grid from `grid_lanes`),
        // and the f32 x over cols (the `_norm` kernels also the dtype norm weight over
        // cols, null and unread otherwise), and writes (the `_res` kernels read and write) the
        // f32 y[r] for r < rows only; extents checked above; y never overlaps x (distinct
        // activation buffers); signature (f32*, const T*, const f32*, int, int, const T*,
        // float) matches. The vector path runs only when cols % 8 == 0; then W's rows and the
        // norm weight are 16-byte aligned and x is 32-byte aligned (it is read as float4
        // pairs), because allocations are 256-byte aligned and every region passed here starts
        // at a whole matrix or vector or at an activation row, i.e. at a multiple of cols
        // elements. W is read before the kernel's programmatic-launch wait (gemv.cu), so it
        // must be complete before this launch and written by no later kernel: every weight is
        // a host upload (synchronised per chunk) or an init kernel followed by a stream
        // synchronize (`CudaDecodeRunner::finish`, `time_projection`), and decode kernels
        // never write weights. The `_pfh` kernels (`_norm` and `_res_et`) make their plain
        // forms' accesses, fewer of the same chunks before the wait. The `_res_et` kernels make
        // the `_res` ones'; their early trigger only lets the next kernel launch sooner, which
        // the caller allows (`GemvIo::AddTo`).
        unsafe { b.launch(cfg_2d((grid, 1, 1), v.block_dim())) }.map_err(Error::driver("gemv"))?;
        Ok(())
    }

    /// `y = W x` (the variant the start-up tuning chose for the shape), a TP rank's partial of
    /// the peer all-reduce that [`Self::peer_add_rmsnorm`] with `pushed` completes next: the
    /// kernel also pushes its outputs into `peer`'s receive slots for that call (gemv.cu's
    /// `_push` kernels). Bit-identical to [`Self::gemv`] followed by the unpushed kernel for
    /// every shape that [`Self::gemv`] launches with 32 lanes a row group (the `_push` kernels
    /// have no short-row form: `plan::gemv_lanes_per_row` gives fewer lanes only to tall
    /// matrices of 16384 rows or more, the LM heads, never to a TP partial).
    pub(crate) fn gemv_push(
        &self,
        peer: &super::peer::PeerRank,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.check_peer(peer, rows, "gemv push")?;
        let py = y.need(rows, "gemv y")?;
        let pw = w.need(rows * cols, "gemv W")?;
        let px = x.need(cols, "gemv x")?;
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let v = self.gemv_table.get(&(rows, cols, false)).copied().unwrap_or_default();
        self.log_gemv((rows, cols, false));
        let k = if v.rows4 {
            pick(self.dtype, Kernel::Gemv4PushF16, Kernel::Gemv4PushBf16)
        } else {
            pick(self.dtype, Kernel::GemvPushF16, Kernel::GemvPushBf16)
        };
        let mut b = self.builder(k);
        b.arg(peer.args()).arg(&py).arg(&pw).arg(&px).arg(&r).arg(&c);
        let grid = v.grid(rows, false)?;
        // SAFETY: as in `gemv_as` (the plain kernel: W over rows x cols, x over cols, y[r] for
        // r < rows; the block shape of the variant), with the signature (PeerArgs, f32*, const
        // T*, const f32*, int, int). The lane storing outputs o, o + 1 also stores line o / 2
        // into every peer's receive slot of the rank's next call, at most ceil(rows / 2) lines
        // of the slot's cap / 2 (rows <= capacity, checked; cap is a multiple of 4), and reads
        // the rank's {epoch, failed} words in its own counter allocation; the peer buffers
        // outlive the kernel
        // (freed only after every device synchronised), and the stream is on the rank's device
        // (checked), whose peer mappings the group enabled.
        unsafe { b.launch(cfg_2d((grid, 1, 1), v.block_dim())) }.map_err(Error::driver("gemv push"))?;
        Ok(())
    }

    /// `h[i] = silu(gate[i] . x) * (up[i] . x)` for `i < inter`, W = [gate; up] (`2*inter` rows,
    /// in the dtype); x and h fp32.
    pub(crate) fn gemv_gateup(
        &self,
        h: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        inter: usize,
        cols: usize,
    ) -> Result<()> {
        self.gemv_gateup_io(h, w, x, inter, cols, None)
    }

    /// [`gemv_gateup`](Self::gemv_gateup) of `RMSNorm(x) * norm_w` when `norm` is
    /// `Some((norm_w, eps))` (x is then the residual stream).
    pub(crate) fn gemv_gateup_io(
        &self,
        h: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        inter: usize,
        cols: usize,
        norm: Option<(Region<'_, u16>, f32)>,
    ) -> Result<()> {
        let ph = h.need(inter, "gateup h")?;
        let pw = w.need(2 * inter * cols, "gateup W")?;
        let px = x.need(cols, "gateup x")?;
        let (pn, eps) = match norm {
            Some((nw, eps)) => (nw.need(cols, "gateup norm weight")?, eps),
            None => (0u64, 0.0f32),
        };
        let (r, c) = (i32_of(inter, "inter")?, i32_of(cols, "cols")?);
        let v = self.gemv_table.get(&(inter, cols, true)).copied().unwrap_or_default();
        self.log_gemv((inter, cols, true));
        let k = match (v.rows4, norm.is_some()) {
            (false, false) => pick(self.dtype, Kernel::GemvGateUpF16, Kernel::GemvGateUpBf16),
            (true, false) => pick(self.dtype, Kernel::Gemv4GateUpF16, Kernel::Gemv4GateUpBf16),
            (false, true) if self.half_prefetch.gateup => {
                pick(self.dtype, Kernel::GemvGateUpNormPfhF16, Kernel::GemvGateUpNormPfhBf16)
            }
            (false, true) => pick(self.dtype, Kernel::GemvGateUpNormF16, Kernel::GemvGateUpNormBf16),
            (true, true) => pick(self.dtype, Kernel::Gemv4GateUpNormF16, Kernel::Gemv4GateUpNormBf16),
        };
        let mut b = self.builder(k);
        b.arg(&ph).arg(&pw).arg(&px).arg(&r).arg(&c).arg(&pn).arg(&eps);
        let grid = v.grid(inter, true)?;
        // SAFETY: each group of ks warps (as in `gemv_io`) computes outputs i < inter only (1 or
        // 2 per group), reading W rows i
        // and inter + i (clamped below inter and 2*inter) over cols and the f32 x over cols
        // (the `_norm` kernels also the dtype norm weight over cols; null and unread
        // otherwise), and writes the f32 h[i] for i < inter; extents checked above; signature
        // (f32*, const T*, const f32*, int, int, const T*, float) matches; alignment as for
        // `gemv_io`; W complete before the launch, as there (read before the wait; the `_pfh`
        // kernel loads fewer of the same chunks there).
        unsafe { b.launch(cfg_2d((grid, 1, 1), v.block_dim())) }.map_err(Error::driver("gemv_gateup"))?;
        Ok(())
    }

    /// `out[t][i] = silu(gu[t][i]) * gu[t][inter + i]`, all fp32.
    pub(crate) fn silu_mul(&self, out: Region<'_, f32>, gu: Region<'_, f32>, inter: usize, n_tok: usize) -> Result<()> {
        let po = out.need(n_tok * inter, "silu out")?;
        let pg = gu.need(n_tok * 2 * inter, "silu gu")?;
        let (i, n) = (i32_of(inter, "inter")?, i32_of(n_tok, "n_tok")?);
        let mut b = self.builder(Kernel::SiluMul);
        b.arg(&po).arg(&pg).arg(&i).arg(&n);
        let grid = grid1((n_tok * inter).div_ceil(256).min(65535))?;
        // SAFETY: grid-stride over k < n_tok*inter: writes out[k], reads gu[t*2*inter + i] and
        // gu[t*2*inter + inter + i] with t < n_tok, i < inter (all f32); extents checked above;
        // signature (f32*, const f32*, int, int) matches.
        unsafe { b.launch(cfg((grid, 1, 1), 256)) }.map_err(Error::driver("silu_mul"))?;
        Ok(())
    }

    /// `out[k] = x[k]` rounded to the dtype for `k < n` (the 16-bit input of a cuBLAS GEMM).
    pub(crate) fn to_dtype(&self, out: Region<'_, u16>, x: Region<'_, f32>, n: usize) -> Result<()> {
        let po = out.need(n, "to_dtype out")?;
        let px = x.need(n, "to_dtype x")?;
        let nn = n as u64;
        let mut b = self.builder(pick(self.dtype, Kernel::ToDtypeF16, Kernel::ToDtypeBf16));
        b.arg(&po).arg(&px).arg(&nn);
        let grid = grid1(n.div_ceil(256).min(65535))?;
        // SAFETY: grid-stride over k < n: reads the f32 x[k], writes out[k]; both extents
        // checked above; signature (T*, const f32*, unsigned long long) matches.
        unsafe { b.launch(cfg((grid, 1, 1), 256)) }.map_err(Error::driver("to_dtype"))?;
        Ok(())
    }

    /// Index of the largest of `n` logits into `out[0]` (smallest index on ties); with
    /// `sample = Some((inv_temp, seed))` a Gumbel-max draw from `softmax(logits * inv_temp)`
    /// instead, hashed from (seed, the position in `feed.step[1]`). With `feed`, the token also
    /// becomes the next device-fed step's input (see `ferrum_argmax_final`). With `split` (a TP
    /// vocab split: the logits are rows `[base, base + n)`), the indices are vocabulary indices
    /// and the final pass writes this rank's candidate to the exchange buffer instead of the
    /// token; the feed then only keys the noise, and [`argmax_pick`](Self::argmax_pick) writes
    /// the token once the buffer was summed over the ranks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn argmax(
        &self,
        logits: Region<'_, f32>,
        n: usize,
        sample: Option<(f32, u64)>,
        part_v: Region<'_, f32>,
        part_i: Region<'_, u32>,
        out: Region<'_, u32>,
        feed: Option<Feed<'_>>,
        split: Option<ArgmaxSplit<'_>>,
    ) -> Result<()> {
        let parts = n.div_ceil(ARGMAX_CHUNK);
        let pl = logits.need(n, "argmax logits")?;
        let pv = part_v.need(parts, "argmax part_v")?;
        let pi = part_i.need(parts, "argmax part_i")?;
        let po = out.need(1, "argmax out")?;
        let (nn, chunk, np) = (i32_of(n, "n")?, ARGMAX_CHUNK as i32, i32_of(parts, "parts")?);
        let (inv_temp, seed) = sample.unwrap_or((0.0, 0));
        let (pstep, phist, cap) = feed_args(&feed)?;
        let (base, px, rank, world) = match &split {
            Some(sp) => {
                // Indices travel as floats through the exchange (exact below 2^24) and as
                // u32 in the kernels.
                if sp.base + n > 1 << 24 || sp.rank >= sp.world {
                    return Err(Error::InvalidArgument(format!(
                        "argmax split: rows {}..{} of rank {} of {} (indices must stay below 2^24)",
                        sp.base,
                        sp.base + n,
                        sp.rank,
                        sp.world
                    )));
                }
                (
                    sp.base as u32,
                    sp.xchg.need(2 * sp.world, "argmax exchange")?,
                    i32_of(sp.rank, "rank")?,
                    i32_of(sp.world, "world")?,
                )
            }
            None => (0u32, 0u64, 0i32, 0i32),
        };
        let mut b = self.builder(Kernel::ArgmaxPartial);
        b.arg(&pl).arg(&nn).arg(&chunk).arg(&inv_temp).arg(&seed).arg(&pstep).arg(&pv).arg(&pi).arg(&base);
        // SAFETY: block b reads logits[b*chunk .. min((b+1)*chunk, n)), step[1] when step is
        // non-null, and writes part[b] for b < parts = ceil(n/chunk); extents checked above;
        // base + n <= 2^24 (checked), so the vocabulary indices fit a u32.
        unsafe { b.launch(cfg((grid1(parts)?, 1, 1), 256)) }.map_err(Error::driver("argmax_partial"))?;
        let mut b = self.builder(Kernel::ArgmaxFinal);
        b.arg(&pv).arg(&pi).arg(&np).arg(&po).arg(&pstep).arg(&phist).arg(&cap).arg(&px).arg(&rank).arg(&world);
        // SAFETY: one block reads part[0 .. parts); with an exchange buffer (split) it writes
        // xchg[0 .. 2 world) only (2 world elements checked, rank < world); otherwise it writes
        // out[0], and with a feed it reads and writes step[0..2] and writes history[i] only for
        // i <= capacity (the kernel checks), and history holds capacity + 1 elements; extents
        // checked above.
        unsafe { b.launch(cfg((1, 1, 1), 256)) }.map_err(Error::driver("argmax_final"))?;
        Ok(())
    }

    /// The vocab split's last step (after the exchange buffer was summed over the ranks): the
    /// best of the `world` candidates in `xchg` becomes the token, written as
    /// [`argmax`](Self::argmax) writes it.
    pub(crate) fn argmax_pick(
        &self,
        xchg: Region<'_, f32>,
        world: usize,
        out: Region<'_, u32>,
        feed: Option<Feed<'_>>,
    ) -> Result<()> {
        let px = xchg.need(2 * world, "argmax exchange")?;
        let po = out.need(1, "argmax out")?;
        let (pstep, phist, cap) = feed_args(&feed)?;
        let w = i32_of(world, "world")?;
        let mut b = self.builder(Kernel::ArgmaxPick);
        b.arg(&px).arg(&w).arg(&po).arg(&pstep).arg(&phist).arg(&cap);
        // SAFETY: one thread reads xchg[0 .. 2 world) and writes out[0]; with a feed, step and
        // history as in `argmax` (history[i] only for i <= capacity, capacity + 1 elements);
        // extents checked above; signature (const f32*, int, u32*, u32*, u32*, int) matches.
        unsafe { b.launch(cfg((1, 1, 1), 32)) }.map_err(Error::driver("argmax_pick"))?;
        Ok(())
    }

    /// The screened head's set-up (misc.cu): `q` (`rows x cols` int8), each row's scale and
    /// bound coefficient, and the largest `max |w|` of a finite row as f32 bits into `wmax`
    /// (which must hold 0 before).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_quantize(
        &self,
        w: Region<'_, u16>,
        rows: usize,
        cols: usize,
        q: Region<'_, i8>,
        scale: Region<'_, f32>,
        coef: Region<'_, f32>,
        wmax: Region<'_, i32>,
    ) -> Result<()> {
        let n = rows.checked_mul(cols).ok_or_else(|| Error::Internal("head size overflows".into()))?;
        let (pw, pq) = (w.need(n, "head W")?, q.need(n, "head q")?);
        let (ps, pc, pm) = (scale.need(rows, "head scale")?, coef.need(rows, "head coef")?, wmax.need(1, "head wmax")?);
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let mut b = self.builder(pick(self.dtype, Kernel::HeadQuantizeF16, Kernel::HeadQuantizeBf16));
        b.arg(&pw).arg(&r).arg(&c).arg(&pq).arg(&ps).arg(&pc).arg(&pm);
        // SAFETY: each warp (8 a block, grid-stride over rows) reads W's row r over cols and
        // writes q's row r, scale[r] and coef[r] for r < rows, and atomically wmax[0]; extents
        // checked above; signature (const T*, int, int, int8*, f32*, f32*, int*) matches.
        unsafe { b.launch(cfg((grid1(rows.div_ceil(8).min(65535))?, 1, 1), 256)) }
            .map_err(Error::driver("head_quantize"))
    }

    /// The folded q/k/v projection's matrix (fold.cu's fold_qkv): from a layer's down
    /// projection `wd` (`hidden x inter`) and the next layer's q/k/v `wqkv` (`qkv x hidden`) and
    /// input norm weight `n1`, `out` (`(hidden + qkv) x (inter + hidden)`) =
    /// `[W_d | I; W_qkv diag(n1) W_d | W_qkv diag(n1)]`; sets `bad[0]` (which must hold 0
    /// before) if an entry is not finite in the dtype.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fold_qkv(
        &self,
        wd: Region<'_, u16>,
        wqkv: Region<'_, u16>,
        n1: Region<'_, u16>,
        hidden: usize,
        inter: usize,
        qkv: usize,
        out: Region<'_, u16>,
        bad: Region<'_, i32>,
    ) -> Result<()> {
        if hidden > FOLD_MAX_HIDDEN {
            return Err(Error::Internal(format!("fold_qkv: hidden {hidden} > {FOLD_MAX_HIDDEN}")));
        }
        let rows = hidden + qkv;
        let n = rows.checked_mul(inter + hidden).ok_or_else(|| Error::Internal("fold size overflows".into()))?;
        let (pd, pq, pn) =
            (wd.need(hidden * inter, "fold W_d")?, wqkv.need(qkv * hidden, "fold W_qkv")?, n1.need(hidden, "fold n1")?);
        let (po, pb) = (out.need(n, "fold out")?, bad.need(1, "fold bad")?);
        let (h, i, q) = (i32_of(hidden, "hidden")?, i32_of(inter, "inter")?, i32_of(qkv, "qkv")?);
        let mut b = self.builder(pick(self.dtype, Kernel::FoldQkvF16, Kernel::FoldQkvBf16));
        b.arg(&pd).arg(&pq).arg(&pn).arg(&h).arg(&i).arg(&q).arg(&po).arg(&pb);
        let mut c = cfg((grid1(rows)?, 1, 1), 256);
        c.shared_mem_bytes = (hidden * 4) as u32;
        // SAFETY: block r (< hidden + qkv) writes row r of out ((inter + hidden) entries) and
        // reads W_d (hidden x inter), W_qkv's row r - hidden (hidden) and n1 (hidden): extents
        // checked above; its dynamic shared memory holds hidden floats (hidden <=
        // FOLD_MAX_HIDDEN: 32 KiB, within the default 48); bad[0] by an atomic OR. Signature
        // (const T* x3, int x3, T*, int*) matches.
        unsafe { b.launch(c) }.map_err(Error::driver("fold_qkv"))
    }

    /// The screened head's screen over rows `base .. base + rows` of the head (`w`, `hs`'s
    /// copy: those rows' regions), with the head GEMV's input `x` (`cols`) and, when the GEMV
    /// fuses the final RMSNorm, its weight and eps; each row's exact logit uses the summation
    /// order of [`gemv_as`](Self::gemv_as)`(.., as_rows)`. Appends the rows that may hold the
    /// argmax to the list (misc.cu); [`head_pick`](Self::head_pick) then picks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_screen(
        &self,
        hs: &HeadScreen<'_>,
        w: Region<'_, u16>,
        x: Region<'_, f32>,
        norm: Option<(Region<'_, u16>, f32)>,
        rows: usize,
        cols: usize,
        as_rows: usize,
    ) -> Result<()> {
        if cols % 16 != 0 || cols > HEAD_MAX_COLS || hs.base + rows > 1 << 24 {
            return Err(Error::Internal(format!("head screen: {cols} columns, rows {}..{}", hs.base, hs.base + rows)));
        }
        let n = rows.checked_mul(cols).ok_or_else(|| Error::Internal("head size overflows".into()))?;
        let (pq, pw, px) = (hs.q.need(n, "head q")?, w.need(n, "head W")?, x.need(cols, "head x")?);
        let (ps, pc) = (hs.scale.need(rows, "head scale")?, hs.coef.need(rows, "head coef")?);
        let (pst, pl) = (hs.state.need(3, "head state")?, hs.list.need(2 * rows, "head list")?);
        let (pn, eps) = match &norm {
            Some((nw, eps)) => (nw.need(cols, "head norm weight")?, *eps),
            None => (0u64, 0.0f32),
        };
        let (v, lanes) = self.gemv_order(as_rows, cols)?;
        let (r, c, ks, lpr) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?, v.ks as i32, lanes as i32);
        let base = hs.base as u32;
        let k = match norm {
            Some(_) => pick(self.dtype, Kernel::HeadScreenNormF16, Kernel::HeadScreenNormBf16),
            None => pick(self.dtype, Kernel::HeadScreenF16, Kernel::HeadScreenBf16),
        };
        let mut b = self.builder(k);
        b.arg(&pq).arg(&ps).arg(&pc).arg(&pw).arg(&px).arg(&pn).arg(&eps).arg(&r).arg(&c).arg(&ks).arg(&lpr);
        b.arg(&hs.ovf).arg(&pst).arg(&pl).arg(&base);
        let mut cf = cfg((grid1(rows.div_ceil(HEAD_ROWS_PER_BLOCK))?, 1, 1), 256);
        cf.shared_mem_bytes = (cols * 5) as u32;
        // SAFETY: block b's warp w reads rows (8b + w) * 8 + 0..8 below `rows` of q (int8), W
        // (the dtype, cols each, 16-byte chunks: cols % 16 == 0 and the regions start at a row,
        // so 16-byte aligned in 256-byte aligned allocations), scale and coef; every block reads
        // x and the norm weight (when non-null) over cols into 5 cols bytes of dynamic shared
        // memory (x', padded: cols <= HEAD_MAX_COLS, 40 KiB at most, below the default 48); it updates
        // state[0..2] atomically and writes list entries (2 u32 each) at indices below rows (one
        // per row at most, the kernel also checks). q is read before the programmatic-launch
        // wait: it was written at set-up, followed by a synchronize, and no decode kernel writes
        // it. ks <= 8 and lanes 8, 16 or 32 come from the GEMV's own plan (gemv_order). The
        // signature (const int8*, const f32*, const f32*, const T*, const f32*, const T*, float,
        // int x4, float, HeadState*, HeadEntry*, unsigned) matches.
        unsafe { b.launch(cf) }.map_err(Error::driver("head_screen"))
    }

    /// The screened head's pick: the best row of the list that [`head_screen`](Self::head_screen)
    /// filled (`rows` its capacity) becomes the token, written as [`argmax`](Self::argmax)
    /// writes it (with a split: this rank's candidate to the exchange buffer); resets `state`.
    pub(crate) fn head_pick(
        &self,
        state: Region<'_, i32>,
        list: Region<'_, u32>,
        rows: usize,
        out: Region<'_, u32>,
        feed: Option<Feed<'_>>,
        split: Option<ArgmaxSplit<'_>>,
    ) -> Result<()> {
        let (pst, pl, po) = (state.need(3, "head state")?, list.need(2 * rows, "head list")?, out.need(1, "head out")?);
        let (pstep, phist, cap) = feed_args(&feed)?;
        let (px, rank, world) = match &split {
            Some(sp) if sp.rank < sp.world => {
                (sp.xchg.need(2 * sp.world, "head exchange")?, i32_of(sp.rank, "rank")?, i32_of(sp.world, "world")?)
            }
            Some(sp) => return Err(Error::Internal(format!("head pick: rank {} of {}", sp.rank, sp.world))),
            None => (0u64, 0i32, 0i32),
        };
        let n = i32_of(rows, "rows")?;
        let mut b = self.builder(Kernel::HeadPick);
        b.arg(&pst).arg(&pl).arg(&n).arg(&po).arg(&pstep).arg(&phist).arg(&cap).arg(&px).arg(&rank).arg(&world);
        // SAFETY: one block reads state[0..2] and list[0 .. 2 min(count, rows)), writes state[0..3];
        // then as `argmax_final`: xchg[0 .. 2 world) with a split (rank < world checked), else
        // out[0] and, with a feed, step[0..2] and history[i] for i <= capacity only (capacity +
        // 1 elements); extents checked above; signature (HeadState*, const HeadEntry*, int, u32*,
        // u32*, u32*, int, f32*, int, int) matches.
        unsafe { b.launch(cfg((1, 1, 1), 256)) }.map_err(Error::driver("head_pick"))
    }

    /// Launches `ferrum_argmax_final` with 2048 threads per block, which CUDA refuses at launch
    /// (the limit is 1024): a genuine driver error for failure tests; the kernel never runs.
    pub(crate) fn invalid_launch(
        &self,
        part_v: Region<'_, f32>,
        part_i: Region<'_, u32>,
        out: Region<'_, u32>,
    ) -> Result<()> {
        let (pv, pi, po) = (part_v.need(1, "part_v")?, part_i.need(1, "part_i")?, out.need(1, "out")?);
        let (one, null, zero) = (1i32, 0u64, 0i32);
        let mut b = self.builder(Kernel::ArgmaxFinal);
        b.arg(&pv).arg(&pi).arg(&one).arg(&po).arg(&null).arg(&null).arg(&zero).arg(&null).arg(&zero).arg(&zero);
        // SAFETY: the driver rejects the launch (a block of 2048 > 1024 threads) before any
        // thread runs. Even if it ran, the arguments are valid: it would read part[0] and write
        // out[0] (extents checked above), with a null step buffer (no device-fed update).
        unsafe { b.launch(cfg((1, 1, 1), 2048)) }.map_err(Error::driver("injected launch (expected to fail)"))?;
        Err(Error::Internal("a launch of 2048 threads per block was accepted".into()))
    }

    /// Launches `ferrum_poison_shared` over `2 * sms` blocks of the whole opt-in shared memory
    /// (at most one resident a multiprocessor; the block scheduler spreads them, so every
    /// multiprocessor very likely runs one, though nothing guarantees it): the shared memory
    /// the next kernels' blocks are given starts as all-ones (NaN), for tests that check no
    /// kernel's results take in shared memory it did not write. Only the kernels that run before
    /// any other kernel writes shared memory see the poison (in a decode step: the first
    /// layer's).
    pub(crate) fn poison_shared(&self, sms: usize) -> Result<()> {
        let blocks = u32::try_from(2 * sms.max(1)).map_err(|_| Error::Internal(format!("{sms} multiprocessors")))?;
        let mut c = cfg((blocks, 1, 1), 256);
        c.shared_mem_bytes = self.smem_optin;
        let mut b = self.builder(Kernel::PoisonShared);
        // SAFETY: the kernel takes no arguments (none given) and writes only its own block's
        // dynamic shared memory, within the size it is launched with, which is the maximum
        // set on the function at load (`smem_optin`).
        unsafe { b.launch(c) }.map_err(Error::driver("poisoning shared memory"))
    }

    /// Fills `out` (`rows x cols`, row-major) with the slice at `(row0, col0)` of a random
    /// matrix of `full_cols` columns whose element `e` is `offset + half_width * u`, `u`
    /// uniform in [-1, 1) hashed from (seed, e). A vector is one row.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn init_uniform(
        &self,
        out: Region<'_, u16>,
        rows: usize,
        cols: usize,
        full_cols: usize,
        row0: usize,
        col0: usize,
        seed: u64,
        offset: f32,
        half_width: f32,
    ) -> Result<()> {
        if col0 + cols > full_cols {
            return Err(Error::Internal(format!("init slice {col0}+{cols} past {full_cols} columns")));
        }
        let n = rows.checked_mul(cols).ok_or_else(|| Error::Internal("init size overflows".into()))?;
        let po = out.need(n, "init out")?;
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let (fc, r0, c0) = (full_cols as i64, row0 as i64, col0 as i64);
        let mut b = self.builder(pick(self.dtype, Kernel::InitUniformF16, Kernel::InitUniformBf16));
        b.arg(&po).arg(&r).arg(&c).arg(&fc).arg(&r0).arg(&c0).arg(&seed).arg(&offset).arg(&half_width);
        let grid = grid1(n.div_ceil(256).min(65535))?;
        // SAFETY: grid-stride writes out[k] for k < rows*cols, the extent checked above; the
        // argument list matches (T*, int, int, long long x3, u64, float, float).
        unsafe { b.launch(cfg((grid, 1, 1), 256)) }.map_err(Error::driver("init_uniform"))?;
        Ok(())
    }

    /// `Y[n][rows] = X[n][cols] · W[rows][cols]^T` through cuBLAS (fp32 compute): W and X in
    /// the dtype, Y in fp32.
    pub(crate) fn gemm(
        &self,
        y: Region<'_, f32>,
        w: Region<'_, u16>,
        x: Region<'_, u16>,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> Result<()> {
        let py = y.need(n * rows, "gemm y")?;
        let pw = w.need(rows * cols, "gemm W")?;
        let px = x.need(n * cols, "gemm X")?;
        let (m, nn, k) = (i32_of(rows, "rows")?, i32_of(n, "n")?, i32_of(cols, "cols")?);
        let ab = match self.dtype {
            DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
        };
        let ct = blas_sys::cudaDataType::CUDA_R_32F;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: column-major view: A = W as [cols x rows] (lda = cols, transposed), B = X as
        // [cols x n] (ldb = cols), C = Y as [rows x n] (ldc = rows). cuBLAS reads rows*cols
        // 16-bit elements of W, n*cols of X and writes n*rows f32 elements of Y (C type
        // CUDA_R_32F), each extent checked above; alpha/beta are host f32 scalars matching
        // CUBLAS_COMPUTE_32F (the handle's default host pointer mode) and outlive the call; the
        // handle is bound to this runner's stream.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha as *const f32).cast(),
                pw as *const std::ffi::c_void,
                ab,
                k,
                px as *const std::ffi::c_void,
                ab,
                k,
                (&beta as *const f32).cast(),
                py as *mut std::ffi::c_void,
                ct,
                m,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(Error::cublas("gemm"))?;
        if let Some(marks) = self.marks.borrow_mut().as_mut() {
            record_mark(&self.stream, marks, "cublas_gemm").map_err(Error::driver("profile event"))?;
        }
        Ok(())
    }
}
