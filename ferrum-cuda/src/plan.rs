//! Launch planning: pure functions of a shape and the GPU's multiprocessor count that decide
//! how the decode kernels are split over the GPU. They hold no GPU state, so they build and
//! are unit-tested without the `cuda` feature; `cuda::launch` and `cuda::CudaDecodeRunner` call
//! them.

/// Largest GEMV split-K factor: gemv.cu's shared slots hold `GEMV_MAX_KS` (8) warps per row
/// group (a split of 8 makes every block one row group of 8 warps). [`gemv_split_k_for`]'s
/// splits past 4 also need [`GEMV_KS8_MIN_STRIPES`] stripes a warp; [`gemv_split_k_exact`] may
/// then raise a split to one stripe a warp (up to 8) where the warp target allows. The
/// `FERRUM_GEMV_SPLIT_K` knob lowers the cap.
pub const GEMV_MAX_KS: u32 = 8;
/// Column stripes (of 32 chunks) each warp keeps at a split past 4: a split of 8 only for rows
/// of 8192 columns or more. Measured on one H200 (session 21, the kernel timeline of
/// Llama-3.2-1B with splits up to 8 for every shape): its down projection (2048 x 8192) took
/// 8.3 µs split 8 ways against 10.6 split 4 ways, while its o projection (2048 x 2048, one
/// stripe a warp at 8) took 2.6 against 2.4; with this rule (the down projection alone split 8
/// ways) Llama-3.2-1B ran 1330 / 1332 / 1331 tok/s against 1309 / 1310 / 1310 with the cap at 4
/// (`FERRUM_GEMV_SPLIT_K=4`), alternating in one call. No other shape of the benchmark models
/// splits past 4 (their warps fill the GPU first).
pub const GEMV_KS8_MIN_STRIPES: usize = 4;

/// Warps per multiprocessor that a GEMV should have streaming its weights. Each warp (two rows)
/// keeps about 4 KiB of loads in flight; an H200 needs about 48 KiB in flight per
/// multiprocessor (4.2 TB/s times about 1.5 µs of loaded latency, over 132 multiprocessors)
/// to stay at its copy bandwidth, so 12 warps at least, and more cover the ramp and the tail:
/// measured on one H200 (session 19, `FERRUM_GEMV_WARPS_PER_SM`, alternating in one call),
/// 32 instead of 16 took Llama-3-8B from 238 to 247 tok/s (its qkv, o and down projections
/// split 2, 4 and 4 ways instead of 1, 2 and 2); 64 was no better at 8B (238) and worse at 1B.
pub const GEMV_WARPS_PER_SM: usize = 32;

/// The split-K factor of a batch-1 GEMV with `rows` weight rows (2·inter for the stacked
/// gate|up) and `cols` columns on a GPU with `sms` multiprocessors: the smallest power of two
/// that gives every multiprocessor [`GEMV_WARPS_PER_SM`] two-row warps, and at most `max_ks`,
/// [`GEMV_MAX_KS`], and the number of 32-chunk column stripes (each warp keeps at least one).
/// A function of the shape, the GPU's multiprocessor count and the `FERRUM_GEMV_SPLIT_K` cap,
/// never of timing: on one GPU model with one setting a shape's result is always the same
/// (another GPU model may split differently and round differently).
pub fn gemv_split_k(rows: usize, cols: usize, sms: usize, max_ks: u32) -> u32 {
    gemv_split_k_for(rows, cols, sms, max_ks, GEMV_WARPS_PER_SM)
}

/// [`gemv_split_k`] aiming at `warps_per_sm` two-row warps per multiprocessor instead of
/// [`GEMV_WARPS_PER_SM`] (the `FERRUM_GEMV_WARPS_PER_SM` measurement knob).
pub fn gemv_split_k_for(rows: usize, cols: usize, sms: usize, max_ks: u32, warps_per_sm: usize) -> u32 {
    let warps = rows.div_ceil(2);
    let stripes = (cols / 8 / 32).max(1);
    let cap = max_ks.clamp(1, GEMV_MAX_KS);
    let mut ks = 1u32;
    while ks * 2 <= cap && ks as usize * 2 <= stripes && warps * (ks as usize) < warps_per_sm * sms {
        // Past a split of 4, only while each warp keeps GEMV_KS8_MIN_STRIPES stripes.
        if ks * 2 > 4 && stripes < GEMV_KS8_MIN_STRIPES * ks as usize * 2 {
            break;
        }
        ks *= 2;
    }
    ks
}

/// [`gemv_split_k_for`], then raised to one 32-chunk column stripe per warp (`ceil(chunks / 32)`,
/// at most `exact_max` and [`GEMV_MAX_KS`]) for shapes that already split (`ks > 1`) but
/// leave some lanes two chunks, as long as the two-row warps stay within the split's own target
/// (`warps_per_sm` a multiprocessor). After its programmatic-launch wait a GEMV lane reads x
/// chunk by chunk (gemv.cu: one branch per chunk), so a lane with two chunks waits two
/// dependent L2 round trips before its warp can reduce, one with one chunk waits one
/// (`scripts/microbench/postwait.cu`, session 26 call 1: a 132-block step took 1.36 µs with the
/// second chunk's loads behind the first's FMAs, 1.06 with both issued together). The split
/// need not be a power of two (the kernels take any `ks` up to [`GEMV_MAX_KS`]). Among the
/// benchmark models only SmolLM2-135M's shapes change: qkv and o (576 columns, 72 chunks) split
/// 3 ways instead of 2, down (1536 columns) 6 instead of 4; its gate|up (3072 rows) would need
/// 4608 warps at 3 and keeps 2. Measured on one H200 (session 26 call 1, with gate|up at 3
/// too): 135M 2520 / 2527 / 2525 tok/s against 2481 / 2485 / 2486, alternating; the kernel
/// timeline's o projection 2.32 → 1.78 µs, down 1.85 → 1.78, qkv 2.15 → 2.07, gate|up 2.46 →
/// 2.70. Llama-3.2-1B's qkv and o raised to 8 (beyond the warp target) lost 2.6%. Unlike
/// [`gemv_split_k_for`] it may split past 4 with one stripe a warp (a 512 × 2048 shape splits
/// 8 ways), which [`GEMV_KS8_MIN_STRIPES`] keeps the plain rule from: session 21 measured
/// Llama-3.2-1B's o projection slower at 8 with one stripe a warp, a shape the warp target now
/// keeps at 4. The `FERRUM_GEMV_KS_EXACT` knob sets `exact_max` (0: off).
pub fn gemv_split_k_exact(
    rows: usize,
    cols: usize,
    sms: usize,
    max_ks: u32,
    warps_per_sm: usize,
    exact_max: u32,
) -> u32 {
    let ks = gemv_split_k_for(rows, cols, sms, max_ks, warps_per_sm);
    let need = (cols / 8).div_ceil(32);
    let cap = exact_max.min(max_ks.max(1)).min(GEMV_MAX_KS) as usize;
    if ks > 1 && need > ks as usize && need <= cap && rows.div_ceil(2) * need <= warps_per_sm * sms {
        need as u32
    } else {
        ks
    }
}

/// Timings within this many tenths of a percent of the fastest count as a tie in the GEMV
/// start-up tuning ([`gemv_pick`]). Overridden by `FERRUM_GEMV_TIE` ([`gemv_tie_permille`]).
///
/// 1% since session 29 (one H200, `FERRUM_GEMV_TIE`, docs/PERF.md): at 0.5%, 3 of 28
/// SmolLM2-135M processes ran ~2430 tok/s against ~2633, and the one whose choices were logged
/// had taken the qkv projection (960 × 576, split 3) as 480 blocks of 96 threads (timed 1.6149
/// µs), so its 240-block launch had timed more than 0.5% slower in that process (1.6085–1.6277
/// µs in the others); at 1% eight processes of eight took the 240-block launch (2632–2638 tok/s;
/// 0 of 8 is not yet significant against 3 of 28); at 2% one of six took a 4-row launch
/// (120 blocks, timed 1.6565 µs) and ran 2599. Llama-3.2-1B and Llama-3-8B ran alike at 0.5% and
/// 2%, and Llama-3-8B at 1% against 0.5% (session 30: 260 / 260 tok/s either way).
pub const GEMV_TIE_PERMILLE: usize = 10;

/// Device-fed decode steps per captured graph (`FERRUM_GRAPH_STEPS` overrides it: a
/// measurement knob): a runner's device-fed steps run as replays of a graph that holds this
/// many consecutive steps (each step's last kernel writes the next step's token and position
/// into the step buffer, and the next step's first kernel waits for it), and a batch's
/// remainder as replays of a one-step graph. Inside one graph the boundary between two steps
/// is a programmatic launch like every other kernel boundary; between two replays the next
/// step starts only after the whole previous graph has completed, and on a TP rank whose graphs
/// hold NCCL kernels (NCCL's all-reduce: `FERRUM_ALLREDUCE=nccl`, GPUs without peer access, a
/// multi-process group) each replay is waited for by the host. Bit-identical for every count
/// (the same kernels in the same order).
pub const GRAPH_STEPS: usize = 1;
/// The most device-fed steps one captured graph may hold.
pub const MAX_GRAPH_STEPS: usize = 32;

/// Device-fed decode steps per captured graph from `FERRUM_GRAPH_STEPS` (`None` when unset:
/// [`GRAPH_STEPS`]), 1..=[`MAX_GRAPH_STEPS`].
pub fn graph_steps(value: Option<&str>) -> crate::Result<usize> {
    Ok(knob("FERRUM_GRAPH_STEPS", value, 1, MAX_GRAPH_STEPS)?.unwrap_or(GRAPH_STEPS))
}

/// `FERRUM_SCREEN_HEAD`: `1` turns the screened LM head on for every new runner, `0` or unset
/// leaves it off (`CudaDecodeRunner::set_screened_head`); anything else is an error.
pub fn screen_head(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_SCREEN_HEAD", value, 0, 1)? == Some(1))
}

/// `FERRUM_FOLD_QKV`: `1` folds the q/k/v projection into the previous layer's down projection
/// for every new runner (`CudaDecodeRunner::set_folded_qkv`), `0` or unset leaves it off;
/// anything else is an error. Off by default: at SmolLM2-135M, the one model whose shapes it
/// might pay for, it measured +0.3% (session 35) and -1.0% (session 36), within the bench's
/// noise; at Llama-3-8B -37% (session 36: [`fold_extra_bytes`]).
pub fn fold_qkv(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_FOLD_QKV", value, 0, 1)? == Some(1))
}

/// Head dims with a folded-q/k/v attention kernel (`ferrum_attn_rope[_early]_fold_hd*`,
/// attention.cu's template instantiated in fold.cu): SmolLM2's 64 and Llama's 128.
pub const FOLD_HEAD_DIMS: &[usize] = &[64, 128];

/// Bytes a layer's folded down projection reads beyond the unfolded down and q/k/v
/// projections (2-byte dtypes): `M` (`qkv x inter`) and the `hidden x hidden` identity block.
pub fn fold_extra_bytes(hidden: usize, inter: usize, qkv: usize) -> usize {
    2 * (qkv * inter + hidden * hidden)
}

/// An upper bound on the extra bytes a layer for which the fold could pay: it saves about one
/// small GEMV's fixed cost a layer (~2.4 us at SmolLM2-135M, session 35's timeline), which
/// buys ~10 MB at the H200's 4.24 TB/s copy bandwidth; above it the fold cannot pay. Below it
/// nothing is promised: SmolLM2-135M's 3.6 MB a layer measured +0.3% (session 35) and -1.0%
/// (session 36). Llama-3-8B's 210 MB measured 270 -> 170 tok/s (-37%, session 36).
/// `set_folded_qkv` warns above it.
pub const FOLD_MAX_EXTRA_BYTES: usize = 10_000_000;

/// `steps` when it is a valid count of device-fed steps per captured graph,
/// 1..=[`MAX_GRAPH_STEPS`], else an `InvalidArgument` error.
pub fn check_graph_steps(steps: usize) -> crate::Result<usize> {
    if (1..=MAX_GRAPH_STEPS).contains(&steps) {
        Ok(steps)
    } else {
        Err(crate::Error::InvalidArgument(format!("{steps} device-fed steps per graph (1..={MAX_GRAPH_STEPS})")))
    }
}

/// The GEMV tuning's tie margin from `FERRUM_GEMV_TIE` (`None` when unset:
/// [`GEMV_TIE_PERMILLE`]), in tenths of a percent, 0..=100 (0: only exact ties, which the
/// fewest blocks still break).
pub fn gemv_tie_permille(value: Option<&str>) -> crate::Result<usize> {
    Ok(knob("FERRUM_GEMV_TIE", value, 0, 100)?.unwrap_or(GEMV_TIE_PERMILLE))
}

/// The GEMV start-up tuning's pick among the timed launches `(median µs, blocks)`: the one with
/// the fewest blocks among those within `tie_permille` tenths of a percent of the fastest (the
/// first of those on a tie), `None` when there are none. Variants that time alike alone may not
/// run alike in the step: SmolLM2-135M's qkv projection (960 × 576, split 3) timed 1.612 µs as
/// 240 blocks of 192 threads and 1.613–1.617 as 480 blocks of 96, a coin flip per process, and
/// the processes that got the 480 blocks ran 2427–2437 tok/s against 2621–2626 (session 26
/// call 5, eight processes on one H200).
pub fn gemv_pick(timed: &[(f32, usize)], tie_permille: usize) -> Option<usize> {
    let fastest = timed.iter().map(|t| t.0).fold(f32::INFINITY, f32::min);
    let tie = fastest * (1.0 + tie_permille as f32 / 1000.0);
    let mut best: Option<usize> = None;
    for (i, &(t, blocks)) in timed.iter().enumerate() {
        if t <= tie && best.is_none_or(|b| blocks < timed[b].1) {
            best = Some(i);
        }
    }
    best
}

/// `FERRUM_GEMV_KS_EXACT` (`None` when unset: [`GEMV_MAX_KS`]): the largest split-K factor
/// [`gemv_split_k_exact`] may raise a shape's split to, 0..=[`GEMV_MAX_KS`] (0, 1 or 2: off,
/// since only a split of 2 or more is raised, and only past itself).
pub fn gemv_ks_exact(value: Option<&str>) -> crate::Result<u32> {
    Ok(knob("FERRUM_GEMV_KS_EXACT", value, 0, GEMV_MAX_KS as usize)?.map_or(GEMV_MAX_KS, |n| n as u32))
}

/// The most outputs one multiprocessor computes when a GEMV of `outputs` outputs is launched as
/// `blocks` blocks of `per_block` outputs each on `sms` multiprocessors (blocks spread evenly:
/// some multiprocessors get `ceil(blocks / sms)`). The start-up tuning times only the launch
/// variants with the least of it, or within [`GEMV_BALANCE_SLACK_PCT`] of it
/// ([`gemv_balanced`]): a GEMV of about one wave or less lasts as long as its busiest
/// multiprocessor, a cost that timing one GEMV alone cannot see. Measured
/// on one H200 (session 22, call 8; the start-up choices of twelve processes logged): the
/// SmolLM2-135M down projection (576 × 1536, split 4 ways) as 144 blocks of 8 warps (two rows
/// a warp: 4 outputs a block, up to 8 on a multiprocessor) or as 288 blocks of 4 warps (up to
/// 6) timed 1.879 against 1.876 µs alone, so the tuning picked either; the processes that got
/// the 288 blocks ran 2485–2495 tok/s, the others 2330–2333 (the bimodality seen since
/// session 15), and one that gave its qkv projection 4 rows a warp (60 blocks of 16 outputs)
/// 2417.
pub fn gemv_sm_load(blocks: usize, per_block: usize, sms: usize) -> usize {
    blocks.div_ceil(sms.max(1)) * per_block
}

/// Which of the candidates `(blocks, outputs per block)` the start-up tuning times: those whose
/// [`gemv_sm_load`] is within [`GEMV_BALANCE_SLACK_PCT`] of the least (at least one, in their
/// order).
pub fn gemv_balanced(candidates: &[(usize, usize)], sms: usize) -> Vec<bool> {
    let load = |&(b, p): &(usize, usize)| gemv_sm_load(b, p, sms);
    let least = candidates.iter().map(load).min().unwrap_or(0);
    candidates.iter().map(|c| load(c) * 100 <= least * (100 + GEMV_BALANCE_SLACK_PCT)).collect()
}

/// How much more than the least busiest-multiprocessor load ([`gemv_sm_load`]) a GEMV variant
/// may have and still be timed: the rounding of many-wave grids (Llama-3-8B's LM head: 992
/// outputs on the busiest multiprocessor as 4008 blocks of 32, 976 as 8016 of 16) is not the
/// one-wave imbalance this guards against (SmolLM2-135M's down projection: 8 against 6, 33%
/// over). Was 10 (session 22), which also kept 4-row warps of 8-warp blocks from the Llama-3-8B
/// TP2 gate|up shard (7168 outputs: 448 blocks of 16, up to 64 on a multiprocessor, against 56
/// for the others, 14% over); measured on two H200 (session 24, call 2; the start-up timing
/// alone gave them 29.8 µs against 31.0 for the 2-row warps the rule left): TP2 ran 411 / 411
/// tok/s with the rule at 10 against 423 / 424 with the session-21 build, which picked them.
pub const GEMV_BALANCE_SLACK_PCT: usize = 20;

/// Most KV splits of the decode attention.
pub const MAX_SPLITS: usize = 64;
/// Target cache rows per split of the row-walking decode attention for long caches (above
/// `MAX_SPLITS * ATTN_ROWS_PER_SPLIT` rows the split cap wins and splits grow longer); the
/// tensor-core decode attention targets [`ATTN_TC_ROWS_PER_SPLIT`] ([`attn_splits_tc`]).
pub const ATTN_ROWS_PER_SPLIT: usize = 128;
/// Fewest cache rows per split when short caches are split for parallelism. Measured on one
/// H200 (session 11, 384-token cache, `FERRUM_ATTN_SPLITS` A/B within one device call): with
/// the attention that walks the cache after its wait, SmolLM2-135M (9 heads) ran 1549–1568
/// tok/s with 6 splits of 64 rows and 1680–1756 with 12 of 32; once the fused attention copied
/// its rows before the wait, 6 splits ran 1926–2084 and 12 splits 1877–1887 (Llama-3.2-1B:
/// 1177–1191 with 6, 1165–1169 with 9). So 64.
pub const ATTN_MIN_ROWS_PER_SPLIT: usize = 64;
/// Cache rows per row slot that the fused decode attention loads before its programmatic-launch
/// wait (attention.cu's `ATTN_EARLY_ROWS`).
pub const ATTN_EARLY_ROWS: usize = 4;

/// A measurement knob's raw text from `std::env::var(name)`'s result: `None` when unset, an
/// `InvalidArgument` error naming the variable when its value is not UTF-8 (never "unset").
pub fn knob_text(name: &str, var: Result<String, std::env::VarError>) -> crate::Result<Option<String>> {
    match var {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(crate::Error::InvalidArgument(format!("{name}: the value is not valid UTF-8")))
        }
    }
}

/// Reads a measurement knob's value (an environment variable's, `None` when unset): a number in
/// `lo..=hi`, else an `InvalidArgument` error naming the variable and the range.
pub fn knob(name: &str, value: Option<&str>, lo: usize, hi: usize) -> crate::Result<Option<usize>> {
    match value {
        None => Ok(None),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if (lo..=hi).contains(&n) => Ok(Some(n)),
            _ => Err(crate::Error::InvalidArgument(format!("{name}={v:?}: expected a number in {lo}..={hi}"))),
        },
    }
}

/// The split-K cap from `FERRUM_GEMV_SPLIT_K` (`None` when unset: [`GEMV_MAX_KS`]): 1, 2, 4
/// or 8.
pub fn gemv_split_k_cap(value: Option<&str>) -> crate::Result<u32> {
    match knob("FERRUM_GEMV_SPLIT_K", value, 1, GEMV_MAX_KS as usize)? {
        Some(n) if n.is_power_of_two() => Ok(n as u32),
        Some(n) => Err(crate::Error::InvalidArgument(format!("FERRUM_GEMV_SPLIT_K={n}: expected 1, 2, 4 or 8"))),
        None => Ok(GEMV_MAX_KS),
    }
}

/// `FERRUM_GEMV_KS_SHAPES` (`None` when unset: none): split-K factors for single GEMV shapes,
/// `ROWSxCOLS:KS` entries separated by commas (`2048x2048:2`; the rows of the stacked gate|up
/// count both halves, as [`gemv_split_k`]'s do), each `KS` in 1..=[`GEMV_MAX_KS`]. They replace
/// what [`gemv_split_k_exact`] would give those shapes (the `FERRUM_GEMV_SPLIT_K` cap
/// included); every other shape keeps its rule. A measurement knob: another split sums in
/// another order, so those shapes round differently (deterministic for one setting).
pub fn gemv_ks_shapes(value: Option<&str>) -> crate::Result<Vec<(usize, usize, u32)>> {
    let Some(v) = value else { return Ok(Vec::new()) };
    let bad = |e: &str| {
        crate::Error::InvalidArgument(format!(
            "FERRUM_GEMV_KS_SHAPES={v:?}: {e} (expected ROWSxCOLS:KS entries separated by commas, KS in 1..={GEMV_MAX_KS})"
        ))
    };
    let mut out = Vec::new();
    for entry in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (shape, ks) = entry.split_once(':').ok_or_else(|| bad(&format!("{entry:?} has no ':'")))?;
        let (rows, cols) = shape.split_once('x').ok_or_else(|| bad(&format!("{shape:?} has no 'x'")))?;
        let num = |t: &str| t.trim().parse::<usize>().ok().filter(|&n| n > 0);
        let (Some(rows), Some(cols), Some(ks)) = (num(rows), num(cols), num(ks)) else {
            return Err(bad(&format!("{entry:?} is not three positive numbers")));
        };
        if ks > GEMV_MAX_KS as usize {
            return Err(bad(&format!("{entry:?}: split {ks}")));
        }
        out.push((rows, cols, ks as u32));
    }
    Ok(out)
}

/// The weight rows of a GEMV shape of `rows` outputs: both halves' `2 * rows` for the stacked
/// gate|up (`gateup`), else `rows`. The split-K rules and [`gemv_ks_shapes`] count these.
pub fn gemv_weight_rows(rows: usize, gateup: bool) -> usize {
    if gateup {
        2 * rows
    } else {
        rows
    }
}

/// The split-K factor that `shapes` ([`gemv_ks_shapes`]) sets for a GEMV of `rows` (gate|up:
/// both halves) by `cols`, if any (the first entry for the shape).
pub fn gemv_ks_shape(shapes: &[(usize, usize, u32)], rows: usize, cols: usize) -> Option<u32> {
    shapes.iter().find(|&&(r, c, _)| (r, c) == (rows, cols)).map(|&(_, _, ks)| ks)
}

/// `FERRUM_GEMV_WARPS_PER_SM` (`None` when unset: [`GEMV_WARPS_PER_SM`]): the two-row warps
/// per multiprocessor that the GEMV split-K factor aims at, 1..=64.
pub fn gemv_warps_per_sm(value: Option<&str>) -> crate::Result<usize> {
    Ok(knob("FERRUM_GEMV_WARPS_PER_SM", value, 1, 64)?.unwrap_or(GEMV_WARPS_PER_SM))
}

/// `FERRUM_SMEM_CARVEOUT` (`None` when unset: the driver picks per kernel): the percentage
/// (0..=100) of the unified L1 / shared memory that every kernel prefers as shared memory.
pub fn smem_carveout(value: Option<&str>) -> crate::Result<Option<usize>> {
    knob("FERRUM_SMEM_CARVEOUT", value, 0, 100)
}

/// `FERRUM_ATTN_TC_CARVEOUT` (`None` when unset: the driver picks, or `FERRUM_SMEM_CARVEOUT`):
/// the percentage (0..=100) of the unified L1 / shared memory that the tensor-core decode
/// attention prefers as shared memory. A measurement knob.
pub fn attn_tc_carveout(value: Option<&str>) -> crate::Result<Option<usize>> {
    knob("FERRUM_ATTN_TC_CARVEOUT", value, 0, 100)
}

/// GEMV launch variants the start-up tuning chooses from (the CUDA runner's `GEMV_VARIANTS`).
pub const GEMV_VARIANT_COUNT: usize = 4;

/// `FERRUM_GEMV_VARIANT` (`None` when unset: the start-up tuning chooses per shape): the index
/// of the one variant every GEMV shape launches, `0..GEMV_VARIANT_COUNT`.
pub fn gemv_variant(value: Option<&str>) -> crate::Result<Option<usize>> {
    knob("FERRUM_GEMV_VARIANT", value, 0, GEMV_VARIANT_COUNT - 1)
}

/// Lanes per row group of a batch-1 GEMV (plain or `_norm`) with `rows` rows, `cols` columns
/// and split-K factor `ks` (gemv.cu's `LPR`): 32 (a warp per two rows), or for a tall matrix
/// of short rows without split-K (`rows >= GEMV_LANE_MIN_ROWS`, `ks == 1`, `cols % 8 == 0`:
/// the LM heads of small models) as many lanes as keep every lane at [`GEMV_LANE_CHUNKS`]
/// 16-byte chunks of a row or more, 8 at least, so that a warp streams several short rows at
/// once instead of leaving most lanes with two or three chunks and the grid with many waves of
/// tiny warps. `lanes` overrides the choice for such shapes (the `FERRUM_GEMV_LANES`
/// measurement knob: 8, 16 or 32). A function of the shape and the knob only, never of timing:
/// the lane count changes the summation order, so it must be the same on every run of one
/// setting. Shapes below `GEMV_LANE_MIN_ROWS` rows (every projection inside a layer, and so
/// every `_push` GEMV, whose kernels have 32 lanes) always take 32.
pub fn gemv_lanes_per_row(rows: usize, cols: usize, ks: u32, lanes: Option<u32>) -> u32 {
    if rows < GEMV_LANE_MIN_ROWS || ks != 1 || cols % 8 != 0 {
        return 32;
    }
    if let Some(l) = lanes {
        return l;
    }
    match cols / 8 {
        c if c >= GEMV_LANE_CHUNKS * 32 => 32,
        c if c >= GEMV_LANE_CHUNKS * 16 => 16,
        _ => 8,
    }
}

/// Fewest 16-byte chunks of a row per lane that [`gemv_lanes_per_row`] aims at.
pub const GEMV_LANE_CHUNKS: usize = 8;
/// Fewest rows for which [`gemv_lanes_per_row`] gives fewer than 32 lanes: about two waves of
/// two-row warps on an H200 (132 multiprocessors of 32 warps), and more rows than any
/// projection inside a layer of the supported models has (their LM heads have 32000 or more).
pub const GEMV_LANE_MIN_ROWS: usize = 16384;

/// `FERRUM_GEMV_LANES` (`None` when unset: [`gemv_lanes_per_row`] chooses): 8, 16 or 32 lanes
/// per row group for the short-row GEMVs.
pub fn gemv_lanes(value: Option<&str>) -> crate::Result<Option<u32>> {
    match knob("FERRUM_GEMV_LANES", value, 8, 32)? {
        None => Ok(None),
        Some(n @ (8 | 16 | 32)) => Ok(Some(n as u32)),
        Some(n) => Err(crate::Error::InvalidArgument(format!("FERRUM_GEMV_LANES={n}: expected 8, 16 or 32"))),
    }
}

/// Most warps per block of the decode attention (attention.cu's `ATTN_MAX_WARPS`).
pub const ATTN_MAX_WARPS: u32 = 8;
/// Head dims whose fused decode attention (`ferrum_attn_rope_*`) runs its own one-instance
/// kernel (`ferrum_attn_rope_hd128_*`, `ferrum_attn_rope_early_hd128_*`) instead of the generic
/// kernel's head-dim switch: bit-identical, and fewer registers (76 against the generic
/// kernel's 102), so more of the next GEMV's warps are resident while it runs. Measured on one
/// H200 (session 20, call 3, three rounds alternating with the generic kernel): Llama-3-8B
/// (head dim 128) **259 / 259 / 259 vs 247 / 247 / 247 tok/s**. Head dim 64 was measured too
/// and left out: Llama-3.2-1B 1282 / 1281 / 1282 vs 1298 / 1298 / 1301, SmolLM2-135M
/// 2475 / 2283 / 2284 vs 2373 / 2371 / 2377. `FERRUM_ATTN_HD_KERNELS=0` turns them off
/// ([`attn_head_dim_kernels`]).
pub const ATTN_OWN_HEAD_DIMS: &[usize] = &[128];

/// `FERRUM_ATTN_HD_KERNELS` (`None` when unset: on): whether the head dims of
/// [`ATTN_OWN_HEAD_DIMS`] take their own decode attention kernel, 0 or 1.
pub fn attn_head_dim_kernels(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_ATTN_HD_KERNELS", value, 0, 1)?.is_none_or(|v| v == 1))
}

/// `FERRUM_ATTN_COMPACT` (`None` when unset: on): whether the fused decode attention's case
/// of [`attn_compact_fits`] runs the compact kernel (attention.cu's `attn_compact_hd64`:
/// registers instead of shared memory and block barriers, each warp's partial pushed to the
/// cluster's first block in one instruction), 0 or 1. On by default: on one H200 (session 42,
/// docs/PERF.md) the graphed decode step is faster with it, SmolLM2-135M 2880–2884 tok/s
/// against 2657–2664, Llama-3.2-1B 1475–1476 against 1429–1433 (7.1 against 8.4 µs a launch in
/// the eager step profile at 1B).
pub fn attn_compact(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_ATTN_COMPACT", value, 0, 1)?.is_none_or(|v| v == 1))
}

/// Which GEMVs of the one-GPU decode step let the next kernel launch at their entry instead of
/// after their programmatic-launch wait (common.cuh's early trigger), so that the next kernel's
/// blocks are dispatched, and start their early weight loads, while this one still waits for
/// its predecessor: `o` (the o projection, before gate|up) and `down` (the down projection,
/// before the next q/k/v projection or the LM head). `FERRUM_EARLY_TRIGGER`: a comma list of
/// `o` and `down`, `0` or empty for none; unset: [`EARLY_TRIGGER_DEFAULT`]. The same
/// arithmetic, so the logits do not change.
///
/// Measured on one H200 (session 47, docs/PERF.md; the patch with every item in
/// `docs/bench/2026-12-04-session47/`): the early trigger of the q/k/v projection, the compact
/// attention, gate|up (with the down projection's residual then loaded after its wait), the
/// embedding and the screened head's kernels did not pay beside these two, so they are not
/// kept.
/// (No `Default`: unset means [`EARLY_TRIGGER_DEFAULT`], none is [`EarlyTrigger::NONE`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EarlyTrigger {
    pub o: bool,
    pub down: bool,
}

impl EarlyTrigger {
    /// No early trigger.
    pub const NONE: EarlyTrigger = EarlyTrigger { o: false, down: false };
}

/// The early triggers by default: both. On one H200 (session 47), alternating in one call
/// against none: SmolLM2-135M 3004 / 3002 tok/s against 2873 / 2885 (+4.4%), Llama-3.2-1B
/// 1482 / 1480 against 1475 / 1476 (+0.4%); in another call 3042 / 3043 / 3043 against 2884 /
/// 2884 / 2882 (+5.5%) and 1491 / 1489 / 1490 against 1482 / 1479 / 1482 (+0.6%). The o
/// projection alone gave 135M +1.7%, the down projection alone −0.5%.
pub const EARLY_TRIGGER_DEFAULT: EarlyTrigger = EarlyTrigger { o: true, down: true };

/// Parses `FERRUM_EARLY_TRIGGER` (see [`EarlyTrigger`]).
pub fn early_trigger(value: Option<&str>) -> crate::Result<EarlyTrigger> {
    let Some(v) = value else { return Ok(EARLY_TRIGGER_DEFAULT) };
    let [o, down] = item_flags("FERRUM_EARLY_TRIGGER", v, ["o", "down"])?;
    Ok(EarlyTrigger { o, down })
}

/// The items of a comma-list knob `var` (`value`, set): which of `items` it names (`0` and
/// empty items name none); any other item is an `InvalidArgument` naming `var`.
fn item_flags<const N: usize>(var: &str, value: &str, items: [&str; N]) -> crate::Result<[bool; N]> {
    let mut on = [false; N];
    for item in value.split(',').map(str::trim).filter(|e| !e.is_empty() && *e != "0") {
        match items.iter().position(|known| *known == item) {
            Some(i) => on[i] = true,
            None => {
                return Err(crate::Error::InvalidArgument(format!(
                    "{var}={value:?}: unknown item {item:?} (expected {}, comma-separated, or 0)",
                    items.join(", ")
                )))
            }
        }
    }
    Ok(on)
}

/// Which GEMVs of the one-GPU decode step load half their usual chunks before their
/// programmatic-launch wait (gemv.cu's `_pfh` kernels; the same chunks in the same order, so
/// the logits do not change):
/// - `gateup`, the fused gate|up `_norm` GEMV, and `res`, the early-triggering `_res` GEMV (the
///   o and down projections), where the tuning chose two-row warps for the shape: 2 chunks a
///   lane instead of 4, so they take 46–48 registers instead of 60–64 and 40 warps fit a
///   multiprocessor instead of 32, beside the kernels they overlap. Their four-row kernels keep
///   all their chunks (half cost Llama-3.2-1B 0.9% on its four-row gate|up, session 48 call 6;
///   on top of `norm`, 1.1% there and 0.3% on its four-row o and down projections, session 49
///   calls 2–3).
/// - `norm`, the `_norm` GEMV (the q/k/v projection, and the LM head's where the whole head
///   runs: sampling, `--full-head`; not measured there), in both row forms: two-row 2 chunks a
///   lane instead of 4 (48 registers instead of 60–64), four-row 1 instead of 2 (62 registers
///   instead of 64: the same allocation, so what changes is only the loads its early blocks
///   put beside the down projection before it, which they slow).
///
/// `FERRUM_GEMV_PF_HALF`: a comma list of `gateup`, `res` and `norm`, `0` or empty for none;
/// unset: [`HALF_PREFETCH_DEFAULT`].
/// (No `Default`: unset means [`HALF_PREFETCH_DEFAULT`], none is [`HalfPrefetch::NONE`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfPrefetch {
    pub gateup: bool,
    pub res: bool,
    pub norm: bool,
}

impl HalfPrefetch {
    /// Every GEMV loads its usual chunks before its wait.
    pub const NONE: HalfPrefetch = HalfPrefetch { gateup: false, res: false, norm: false };
}

/// Half the early chunks by default for all three. On one H200, alternating in one call:
/// session 48 call 7, SmolLM2-135M (whose gate|up, o and down projections the tuning launches
/// as two-row warps), `gateup,res` 3119 / 3112 / 3121 tok/s against 2995 / 3004 / 3006 with
/// none (+3.8%; `gateup` alone 3096 / 3093 / 3096, `res` alone 3054 / 3058 / 3056). Session 49
/// call 3, `norm` added to `gateup,res`: SmolLM2-135M (two-row q/k/v) 3172 / 3179 / 3174
/// against 3125 / 3119 / 3119 (+1.7%), Llama-3.2-1B (four-row q/k/v) 1507 / 1506 / 1510
/// against 1490 / 1490 / 1488 (+1.2%), Llama-3-8B 264 / 264 against 265 / 265 (−0.5%:
/// 264.1 against 265.4 unrounded).
pub const HALF_PREFETCH_DEFAULT: HalfPrefetch = HalfPrefetch { gateup: true, res: true, norm: true };

/// Parses `FERRUM_GEMV_PF_HALF` (see [`HalfPrefetch`]).
pub fn half_prefetch(value: Option<&str>) -> crate::Result<HalfPrefetch> {
    let Some(v) = value else { return Ok(HALF_PREFETCH_DEFAULT) };
    let [gateup, res, norm] = item_flags("FERRUM_GEMV_PF_HALF", v, ["gateup", "res", "norm"])?;
    Ok(HalfPrefetch { gateup, res, norm })
}

/// Rows of one split the compact decode attention holds (attention.cu's `C64_ROWS`: 16 row
/// slots of [`ATTN_EARLY_ROWS`] early rows).
pub const ATTN_COMPACT_ROWS: usize = 16 * ATTN_EARLY_ROWS;

/// Floats of one warp's partial in the compact attention's merge buffer (`C64_PART`).
const ATTN_COMPACT_PART: usize = 68;

/// Whether a decode attention launch is the compact kernel's case: one token, head dim 64,
/// the 4 warps with early copies that [`attn_warps`] gives, the splits of a head as one
/// cluster, and at most [`ATTN_COMPACT_ROWS`] rows a split at any position
/// (`ceil(capacity / n_splits)`). Bias, norms and the fold are the caller's to exclude.
pub fn attn_compact_fits(
    head_dim: usize,
    n_tok: usize,
    warps: u32,
    early: bool,
    cluster: bool,
    n_splits: usize,
    capacity: usize,
) -> bool {
    head_dim == 64
        && n_tok == 1
        && warps == 4
        && early
        && cluster
        && (2..=ATTN_MAX_CLUSTER).contains(&n_splits)
        && capacity.div_ceil(n_splits) <= ATTN_COMPACT_ROWS
}

/// Dynamic shared memory of a compact decode attention launch: block 0's merge buffer
/// (`n_splits` x 4 warps' partials) and the early copies of 4 warps.
pub fn attn_compact_dyn_bytes(n_splits: usize) -> u32 {
    (n_splits * 4 * ATTN_COMPACT_PART * 4) as u32 + 2 * ATTN_EARLY_ROWS as u32 * 4 * 32 * 16
}

/// `FERRUM_ATTN_O` (`None` when unset: off): whether one-GPU decode steps do the o projection
/// inside the decode attention where it applies ([`attn_o_fits`], the cluster merge), 0 or 1.
/// Off by default: measured slower (SmolLM2-135M on one H200, session 28: 2232–2238 tok/s
/// against 2607–2615 without; docs/PERF.md).
pub fn attn_o(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_ATTN_O", value, 0, 1)? == Some(1))
}

/// Head dims of the tensor-core prefill attention (attention.cu's `attn_prefill` switch);
/// others take the row-walking kernel.
pub const PREFILL_HEAD_DIMS: &[usize] = &[16, 32, 64, 96, 128];
/// Caches of at least this many rows take the tensor-core decode attention
/// (`ferrum_attn_gqa_*`, after a separate `rope_qkv`) instead of the fused row-walking kernel,
/// which reads every K/V row once per q head. Overridden by `FERRUM_ATTN_TC_MIN_CAPACITY`.
/// Measured on one H200 (session 12, `FERRUM_ATTN_TC_MIN_CAPACITY` A/B alternating within one
/// device call, bf16, 256 new tokens): capacity 8192, Llama-3-8B 183 vs 167 tok/s; 2176: 8B 224
/// vs 207, Llama-3.2-1B 1118 vs 1001; 1024: 8B 226 vs 211, 1B 1113 vs 1072; 384: 8B 223 vs
/// 226, 1B 1137 vs 1176, SmolLM2-135M 1897 vs 1939 (the fused kernel's early copies win
/// there). So 1024.
pub const ATTN_TC_MIN_CAPACITY: usize = 1024;
/// The tensor-core decode threshold from `FERRUM_ATTN_TC_MIN_CAPACITY` (`None` when unset:
/// [`ATTN_TC_MIN_CAPACITY`]): a row count of at least 1 (1 takes every cache; a count above any
/// capacity, none).
pub fn attn_tc_min_capacity(value: Option<&str>) -> crate::Result<usize> {
    Ok(knob("FERRUM_ATTN_TC_MIN_CAPACITY", value, 1, u32::MAX as usize)?.unwrap_or(ATTN_TC_MIN_CAPACITY))
}

/// Most q heads per KV head that the tensor-core decode attention takes (the 16 rows of one
/// mma tile).
pub const ATTN_TC_MAX_GROUP: usize = 16;

/// Whether a decode step over a cache of `capacity` rows takes the tensor-core attention: head
/// dims of the tensor-core kernels, at most [`ATTN_TC_MAX_GROUP`] q heads per KV head, and a
/// capacity of at least `min_capacity` (a launch shape: the graph of a step depends on the
/// capacity, never on the length).
pub fn attn_tensor_core(head_dim: usize, heads: usize, kv_heads: usize, capacity: usize, min_capacity: usize) -> bool {
    PREFILL_HEAD_DIMS.contains(&head_dim)
        && kv_heads > 0
        && heads % kv_heads == 0
        && heads / kv_heads <= ATTN_TC_MAX_GROUP
        && capacity >= min_capacity
}

/// Warps per block of the prefill attention (attention.cu's `PF_WARPS`); each takes 16 query
/// rows, so a block covers `16 * PREFILL_WARPS` rows.
pub const PREFILL_WARPS: u32 = 4;

/// KV splits of the row-walking decode attention (short caches; [`attn_splits_tc`] for the
/// tensor-core one) for a sequence of `capacity` tokens, fixed per sequence so
/// the grid never changes (the kernel spreads the current length over them): at least about
/// two blocks per multiprocessor over the `heads` (but at least [`ATTN_MIN_ROWS_PER_SPLIT`]
/// rows per split), and for long caches at most [`ATTN_ROWS_PER_SPLIT`] rows per split; capped
/// at [`MAX_SPLITS`].
pub fn attn_splits(capacity: usize, heads: usize, sms: usize) -> usize {
    splits_of(capacity, heads, sms, ATTN_ROWS_PER_SPLIT)
}

/// Target cache rows per split of the tensor-core decode attention (`ferrum_attn_gqa_*`, the
/// caches of [`attn_tensor_core`]): one warp walks a split for a whole KV group, and the
/// combine kernel after it merges every split, so fewer, longer splits than the row-walking
/// kernel's pay. Measured on one H200 (session 20, call 7, Llama-3-8B at 8192 rows, two rounds
/// alternating, `FERRUM_ATTN_SPLITS`): 64 splits of 128 rows (the row-walking target) 217 / 217
/// tok/s, **32 of 256 rows 220 / 220**, 16 of 512 rows 211 / 211. Caches of 1024–4096 rows
/// (9–16 splits by this rule, 9–32 by the row-walking one) were not measured.
pub const ATTN_TC_ROWS_PER_SPLIT: usize = 256;

/// [`attn_splits`] for a sequence whose decode runs the tensor-core attention: the same
/// spread for parallelism, with [`ATTN_TC_ROWS_PER_SPLIT`] rows per split for long caches.
pub fn attn_splits_tc(capacity: usize, heads: usize, sms: usize) -> usize {
    splits_of(capacity, heads, sms, ATTN_TC_ROWS_PER_SPLIT)
}

fn splits_of(capacity: usize, heads: usize, sms: usize, rows_per_split: usize) -> usize {
    let wide = (2 * sms).div_ceil(heads.max(1)).min(capacity.div_ceil(ATTN_MIN_ROWS_PER_SPLIT));
    wide.max(capacity.div_ceil(rows_per_split)).clamp(1, MAX_SPLITS)
}

/// How the fused decode attention runs over splits of at most `rows` cache rows of
/// `head_dim`: (warps per block, early copies). A warp walks 32 / G rows at a time (attention.cu:
/// G = the power of two >= head_dim / 8), and with early copies each row slot holds
/// [`ATTN_EARLY_ROWS`] rows copied before the programmatic-launch wait. 4 warps when they hold
/// the whole split, else 8 when those do; longer splits (long contexts) take 4 warps and no
/// early copies, whose 16–32 KiB of shared memory per block would cut the blocks resident per
/// multiprocessor (measured: 8k context fell from 165 to 140 tok/s with them).
pub fn attn_warps(head_dim: usize, rows: usize) -> (u32, bool) {
    let g = (head_dim / 8).next_power_of_two().clamp(2, 32);
    let slots_per_warp = 32 / g;
    if rows <= 4 * slots_per_warp * ATTN_EARLY_ROWS {
        (4, true)
    } else if rows <= 8 * slots_per_warp * ATTN_EARLY_ROWS {
        (8, true)
    } else {
        (4, false)
    }
}

/// Most KV splits whose blocks run as one thread-block cluster and merge through distributed
/// shared memory (attention.cu's `ATTN_MAX_CLUSTER`: the portable cluster size).
pub const ATTN_MAX_CLUSTER: usize = 8;

/// Whether the decode attention's `n_splits` blocks of each head run as one thread-block
/// cluster (sm_90 and later: `sm90`) and merge through distributed shared memory: 2 to
/// [`ATTN_MAX_CLUSTER`] splits.
pub fn attn_cluster(n_splits: usize, sm90: bool) -> bool {
    sm90 && (2..=ATTN_MAX_CLUSTER).contains(&n_splits)
}

/// The cluster merge buffer (attention.cu's `attn_merge_bytes`): `n_splits` rows of
/// `head_dim` floats and `n_splits` (max, sum) pairs, rounded up to 16 bytes.
pub fn attn_merge_bytes(n_splits: usize, head_dim: usize) -> u32 {
    ((n_splits * (head_dim + 2) * 4) as u32).next_multiple_of(16)
}

/// Dynamic shared memory of a decode attention launch: the cluster merge buffer (with
/// `cluster`), then the early K/V copies, two 16-byte chunks per early row per thread
/// (attention.cu's `s_early`), or none.
pub fn attn_dyn_bytes(warps: u32, early: bool, cluster: bool, n_splits: usize, head_dim: usize) -> u32 {
    let merge = if cluster { attn_merge_bytes(n_splits, head_dim) } else { 0 };
    let early = if early { 2 * ATTN_EARLY_ROWS as u32 * warps * 32 * 16 } else { 0 };
    merge + early
}

/// The most shared memory the o projection inside the decode attention takes in one block for
/// its W_o slice ([`attn_o_bytes`]); wider slices keep the separate o GEMV. 32 KiB takes
/// SmolLM2-135M (hidden 576, head dim 64, 6 splits: 13.5 KiB), the one model it was measured on;
/// Llama-3.2-1B's (hidden 2048) would need 48 KiB at 6 splits (36 at 8; its short caches take
/// more splits than a cluster holds, so it never applies there).
pub const ATTN_O_MAX_BYTES: u32 = 32 * 1024;

/// Head dims with an o-fused decode attention kernel (attention.cu's
/// `ferrum_attn_rope[_early]_o_hd64_*`; one instance each keeps the PTX small).
pub const ATTN_O_HEAD_DIMS: &[usize] = &[64];

/// A bound on the static shared memory of the decode attention kernels (attention.cu's
/// `ATTN_SMEM_FLOATS` floats and a few scalars: 13.2–13.8 KiB), kept out of the dynamic
/// allowance so the two fit the GPU's opt-in limit per block.
pub const ATTN_STATIC_SMEM_BOUND: u32 = 16 * 1024;

/// Rows of a head's o-projection share that each of the `n_splits` blocks of its cluster takes
/// (attention.cu's `attn_o_rows`).
pub fn attn_o_rows(hidden: usize, n_splits: usize) -> usize {
    hidden.div_ceil(n_splits.max(1))
}

/// Shared memory of one block's W_o slice in the o-fused decode attention (attention.cu's
/// `attn_o_bytes`): [`attn_o_rows`] rows of `head_dim + 8` 16-bit values (the pad keeps the row
/// reads free of bank conflicts), rounded up to 16 bytes.
pub fn attn_o_bytes(hidden: usize, head_dim: usize, n_splits: usize) -> u32 {
    let b = attn_o_rows(hidden, n_splits).saturating_mul(head_dim + 8).saturating_mul(2);
    u32::try_from(b).unwrap_or(u32::MAX).saturating_add(15) & !15
}

/// The dynamic shared-memory allowance of the o-fused decode attention kernels, set at load:
/// the most the other parts take ([`attn_max_dyn_bytes`]) plus [`ATTN_O_MAX_BYTES`], or what
/// the GPU's opt-in limit per block (`optin`) leaves beside the static shared memory where
/// that is less (not on 99 KiB GPUs such as sm_86 / sm_89 / sm_120, where the sum, ~72 KiB,
/// fits; on a 48 KiB one).
pub fn attn_o_smem_max(optin: u32) -> u32 {
    (attn_max_dyn_bytes() + ATTN_O_MAX_BYTES).min(optin.saturating_sub(ATTN_STATIC_SMEM_BOUND))
}

/// Whether a decode attention launch of `n_splits` splits that already takes `dyn_bytes` of
/// dynamic shared memory ([`attn_dyn_bytes`]) can also do the o projection of `hidden` rows at
/// `head_dim` (one of [`ATTN_O_HEAD_DIMS`]): the splits of each head run as one cluster
/// ([`attn_cluster`] on sm_90: the caller checks; here 2..=[`ATTN_MAX_CLUSTER`]), each block's
/// W_o slice within [`ATTN_O_MAX_BYTES`], and the whole within `max_bytes` (the kernels'
/// allowance, [`attn_o_smem_max`]).
pub fn attn_o_fits(dyn_bytes: u32, hidden: usize, head_dim: usize, n_splits: usize, max_bytes: u32) -> bool {
    let o = attn_o_bytes(hidden, head_dim, n_splits);
    hidden > 0
        && ATTN_O_HEAD_DIMS.contains(&head_dim)
        && (2..=ATTN_MAX_CLUSTER).contains(&n_splits)
        && o <= ATTN_O_MAX_BYTES
        && dyn_bytes.saturating_add(o) <= max_bytes
}

/// Cache rows per K/V tile of the tensor-core attention kernels (attention.cu's `PF_BN`).
pub const PF_TILE_ROWS: usize = 32;

/// Shared-memory stages of the tensor-core decode attention (`ferrum_attn_gqa_*`): each holds
/// one [`PF_TILE_ROWS`]-row K and V tile, and a warp keeps up to `stages - 1` tiles in flight,
/// those of its first `stages - 1` whose rows precede the new token issued before the
/// programmatic-launch wait. Overridden by `FERRUM_ATTN_TC_STAGES` ([`attn_tc_stages`]).
pub const ATTN_TC_STAGES: usize = 5;
/// Most stages [`attn_tc_stages`] accepts (attention.cu's `PF_MAX_STAGES`).
pub const ATTN_TC_MAX_STAGES: usize = 6;

/// The tensor-core decode attention's stage count from `FERRUM_ATTN_TC_STAGES` (`None` when
/// unset: [`ATTN_TC_STAGES`]), 2..=[`ATTN_TC_MAX_STAGES`].
pub fn attn_tc_stages(value: Option<&str>) -> crate::Result<usize> {
    Ok(knob("FERRUM_ATTN_TC_STAGES", value, 2, ATTN_TC_MAX_STAGES)?.unwrap_or(ATTN_TC_STAGES))
}

/// Whether the tensor-core decode attention issues its first tiles before the
/// programmatic-launch wait (those whose rows all precede the new token's). Overridden by
/// `FERRUM_ATTN_TC_EARLY` ([`attn_tc_early`]).
pub const ATTN_TC_EARLY: bool = true;

/// `FERRUM_ATTN_TC_EARLY` (`None` when unset: [`ATTN_TC_EARLY`]), 0 or 1.
pub fn attn_tc_early(value: Option<&str>) -> crate::Result<bool> {
    Ok(knob("FERRUM_ATTN_TC_EARLY", value, 0, 1)?.map_or(ATTN_TC_EARLY, |v| v == 1))
}

/// The stage count a tensor-core decode attention launch of head dim `head_dim` runs: the
/// largest at most `stages` whose [`attn_gqa_dyn_bytes`] fit `max_bytes` (the block's opt-in
/// limit: 227 KiB on an H100 or H200, 99 KiB on sm_86 / sm_89 / sm_120 GPUs), and at least 2
/// (34 KiB at head dim 128, within the 48 KiB every block gets). Bit-identical either way.
pub fn attn_tc_stages_fitting(stages: usize, head_dim: usize, max_bytes: u32) -> usize {
    (2..=stages.max(2)).rev().find(|&s| attn_gqa_dyn_bytes(s, head_dim) <= max_bytes).unwrap_or(2)
}

/// Dynamic shared memory of a tensor-core decode attention launch: `stages` K and V tiles of
/// [`PF_TILE_ROWS`] rows, each row `head_dim + 8` 16-bit elements (attention.cu's
/// `PfLayout`: the pad keeps ldmatrix free of bank conflicts).
pub fn attn_gqa_dyn_bytes(stages: usize, head_dim: usize) -> u32 {
    (stages * 2 * PF_TILE_ROWS * (head_dim + 8) * 2) as u32
}

/// The most dynamic shared memory a decode attention launch asks for (8 warps with early
/// copies, [`ATTN_MAX_CLUSTER`] splits of head dim 256): the kernels are allowed that much at
/// load, since with their static shared memory it passes the default 48 KiB per block.
pub fn attn_max_dyn_bytes() -> u32 {
    attn_dyn_bytes(ATTN_MAX_WARPS, true, true, ATTN_MAX_CLUSTER, 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: usize = 132;

    #[test]
    fn per_shape_splits_parse_or_fail_clearly() {
        assert_eq!(gemv_ks_shapes(None).unwrap(), vec![]);
        assert_eq!(gemv_ks_shapes(Some("")).unwrap(), vec![]);
        assert_eq!(gemv_ks_shapes(Some("2048x2048:2")).unwrap(), vec![(2048, 2048, 2)]);
        let two = gemv_ks_shapes(Some(" 2048x2048:1, 3072x2048:3 ,")).unwrap();
        assert_eq!(two, vec![(2048, 2048, 1), (3072, 2048, 3)]);
        assert_eq!(gemv_ks_shape(&two, 3072, 2048), Some(3));
        assert_eq!(gemv_ks_shape(&two, 2048, 3072), None);
        // gate|up counts both halves (Llama-3.2-1B: 8192 outputs, 16384 weight rows).
        assert_eq!(gemv_weight_rows(8192, true), 16384);
        assert_eq!(gemv_weight_rows(2048, false), 2048);
        for bad in ["2048x2048", "2048:2", "2048x2048:9", "2048x2048:0", "ax2:1", "0x2048:2", "2048x2048:-1"] {
            let e = gemv_ks_shapes(Some(bad)).unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)), "{bad:?}: {e:?}");
            assert!(e.to_string().contains("FERRUM_GEMV_KS_SHAPES"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn the_o_fusion_is_opt_in() {
        assert!(!attn_o(None).unwrap());
        assert!(!attn_o(Some("0")).unwrap());
        assert!(attn_o(Some("1")).unwrap());
        assert!(attn_o(Some("2")).is_err());
        assert!(attn_o(Some("yes")).is_err());
    }

    #[test]
    fn the_o_slice_fits_small_models_only() {
        // SmolLM2-135M, 6 splits: 96 rows of 64 + 8 values, 2 bytes each.
        assert_eq!(attn_o_rows(576, 6), 96);
        assert_eq!(attn_o_bytes(576, 64, 6), 96 * 72 * 2);
        assert_eq!(attn_o_rows(577, 6), 97);
        assert_eq!(attn_o_bytes(3, 16, 2) % 16, 0);
        let h200 = attn_o_smem_max(227 * 1024);
        assert_eq!(h200, attn_max_dyn_bytes() + ATTN_O_MAX_BYTES);
        let dyn8 = attn_dyn_bytes(8, true, true, ATTN_MAX_CLUSTER, 64);
        assert!(attn_o_fits(dyn8, 576, 64, 6, h200));
        assert!(attn_o_fits(dyn8, 576, 64, ATTN_MAX_CLUSTER, h200));
        // One split (no cluster) or more than a cluster holds: never.
        assert!(!attn_o_fits(0, 576, 64, 1, h200));
        assert!(!attn_o_fits(0, 576, 64, ATTN_MAX_CLUSTER + 1, h200));
        // Llama-3.2-1B's slice is past the cap; no rows, nothing to do; head dim 128 has no kernel.
        assert!(!attn_o_fits(0, 576, 128, 6, h200));
        assert!(!attn_o_fits(0, 2048, 64, 6, h200));
        assert!(!attn_o_fits(0, 0, 64, 6, h200));
        // The allowance leaves room for the static part under the GPU's opt-in limit: all of it
        // on a 99 KiB GPU, less on a 48 KiB one; a zero allowance fits nothing.
        assert_eq!(attn_o_smem_max(99 * 1024), h200);
        assert!(attn_o_fits(dyn8, 576, 64, 6, attn_o_smem_max(99 * 1024)));
        assert_eq!(attn_o_smem_max(48 * 1024), 32 * 1024);
        assert!(!attn_o_fits(dyn8, 576, 64, 6, attn_o_smem_max(48 * 1024)));
        assert!(!attn_o_fits(0, 576, 64, 6, 0));
    }

    #[test]
    fn split_k_feeds_small_projections_and_leaves_wide_ones() {
        // Llama-3.2-1B: qkv 3072x2048, o 2048x2048, down 2048x8192 are short of warps.
        assert_eq!(gemv_split_k(3072, 2048, H200_SMS, 4), 4);
        assert_eq!(gemv_split_k(2048, 2048, H200_SMS, 4), 4);
        assert_eq!(gemv_split_k(2048, 8192, H200_SMS, 4), 4);
        // ... and gate|up (2 x 8192 rows) and the LM head are not.
        assert_eq!(gemv_split_k(16384, 2048, H200_SMS, 4), 1);
        assert_eq!(gemv_split_k(128256, 2048, H200_SMS, 4), 1);
        // Llama-3-8B: qkv 6144x4096 split 2 ways, o 4096x4096 and down 4096x14336 4 ways
        // (1, 2 and 2 at 16 warps per SM); gate|up (2 x 14336 rows) not at all.
        assert_eq!(gemv_split_k(6144, 4096, H200_SMS, 4), 2);
        assert_eq!(gemv_split_k(4096, 4096, H200_SMS, 4), 4);
        assert_eq!(gemv_split_k(4096, 14336, H200_SMS, 4), 4);
        assert_eq!(gemv_split_k(28672, 4096, H200_SMS, 4), 1);
        // The knob's target: at 16 warps per SM the 8B qkv is not split.
        assert_eq!(gemv_split_k_for(6144, 4096, H200_SMS, 4, 16), 1);
    }

    #[test]
    fn attention_splits_and_warps() {
        // 384-token sequences: 64-row splits; 8k: 128-row splits, the 64-split cap at 8192.
        assert_eq!(attn_splits(384, 32, H200_SMS), 6);
        assert_eq!(attn_splits(384, 9, H200_SMS), 6);
        assert_eq!(attn_splits(4096, 64, H200_SMS), 32);
        assert_eq!(attn_splits(8192, 32, H200_SMS), 64);
        assert_eq!(attn_splits(100_000, 32, H200_SMS), MAX_SPLITS);
        assert_eq!(attn_splits(1, 32, H200_SMS), 1);
        // The tensor-core kernel's longer splits: 8B at 8k context 32 instead of 64; short
        // and mid-size caches keep the spread for parallelism.
        assert_eq!(attn_splits_tc(8192, 32, H200_SMS), 32);
        assert_eq!(attn_splits_tc(4096, 32, H200_SMS), 16);
        assert_eq!(attn_splits_tc(1024, 32, H200_SMS), attn_splits(1024, 32, H200_SMS));
        assert_eq!(attn_splits_tc(1 << 20, 32, H200_SMS), MAX_SPLITS);
        // Head dim 128 (G = 16, two rows per warp): 4 warps hold 32 early rows, 8 warps 64,
        // beyond that 4 warps and no early copies.
        assert_eq!(attn_warps(128, 32), (4, true));
        assert_eq!(attn_warps(128, 64), (8, true));
        assert_eq!(attn_warps(128, 65), (4, false));
        // Head dim 64 (G = 8, four rows per warp): 64 and 128 rows.
        assert_eq!(attn_warps(64, 64), (4, true));
        assert_eq!(attn_warps(64, 128), (8, true));
        assert_eq!(attn_warps(64, 129), (4, false));
        // Head dims 16, 96 and 256 (G = 2, 16 and 32).
        assert_eq!(attn_warps(16, 256), (4, true));
        assert_eq!(attn_warps(96, 33), (8, true));
        assert_eq!(attn_warps(256, 33), (4, false));
        // The early buffer: 32 KiB for 8 warps; the cluster merge buffer before it.
        assert_eq!(attn_dyn_bytes(8, true, false, 6, 128), 32 * 1024);
        assert_eq!(attn_dyn_bytes(4, true, false, 6, 128), 16 * 1024);
        assert_eq!(attn_dyn_bytes(8, false, false, 6, 128), 0);
        // 6 splits of head dim 128: 6 * 130 floats = 3120 bytes (a multiple of 16).
        assert_eq!(attn_dyn_bytes(8, true, true, 6, 128), 3120 + 32 * 1024);
        // 3 splits of head dim 64: 3 * 66 * 4 = 792 bytes, rounded up to 800.
        assert_eq!(attn_merge_bytes(3, 64), 800);
        assert_eq!(attn_dyn_bytes(4, false, true, 3, 64), 800);
        assert_eq!(attn_max_dyn_bytes(), 8 * 258 * 4 + 32 * 1024);
    }

    #[test]
    fn compact_attention_case_and_shared_memory() {
        // The bench's cache (384 rows, 6 splits: 64 rows each) fits; one row more does not.
        assert!(attn_compact_fits(64, 1, 4, true, true, 6, 384));
        assert!(!attn_compact_fits(64, 1, 4, true, true, 6, 385));
        assert!(!attn_compact_fits(128, 1, 4, true, true, 6, 384));
        assert!(!attn_compact_fits(64, 2, 4, true, true, 6, 384));
        assert!(!attn_compact_fits(64, 1, 8, true, true, 6, 384));
        assert!(!attn_compact_fits(64, 1, 4, false, true, 6, 384));
        assert!(!attn_compact_fits(64, 1, 4, true, false, 6, 384));
        assert!(!attn_compact_fits(64, 1, 4, true, true, 1, 32));
        assert!(!attn_compact_fits(64, 1, 4, true, true, 9, 384));
        for n_splits in 2..=ATTN_MAX_CLUSTER {
            for capacity in [1, 63, 64, 65, 128, 384, 512, 513] {
                if attn_compact_fits(64, 1, 4, true, true, n_splits, capacity) {
                    // Whenever it fits, the host's plan gives 4 warps with early copies.
                    assert_eq!(attn_warps(64, capacity.div_ceil(n_splits)), (4, true), "{n_splits} {capacity}");
                }
            }
            // Within what the kernels are allowed at load, and 16-byte aligned.
            assert!(attn_compact_dyn_bytes(n_splits) <= attn_max_dyn_bytes());
            assert_eq!(attn_compact_dyn_bytes(n_splits) % 16, 0);
        }
        assert_eq!(attn_compact_dyn_bytes(6), 6 * 4 * 68 * 4 + 16384);
    }

    #[test]
    fn cluster_merge_needs_sm90_and_at_most_eight_splits() {
        assert!(attn_cluster(6, true));
        assert!(attn_cluster(2, true) && attn_cluster(ATTN_MAX_CLUSTER, true));
        assert!(!attn_cluster(1, true), "one split has nothing to merge");
        assert!(!attn_cluster(9, true) && !attn_cluster(64, true));
        assert!(!attn_cluster(6, false), "no clusters before sm_90");
    }

    #[test]
    fn the_fold_pays_only_where_its_extra_bytes_are_few() {
        // The folded matrix [W_d | I; M | W_qkv diag(n1)] is (h + q) x (inter + h); it
        // replaces W_d (h x inter) and W_qkv (q x h), two bytes an entry.
        let by_shape = |h: usize, inter: usize, q: usize| 2 * ((h + q) * (inter + h) - h * inter - q * h);
        // (hidden, MLP width, q/k/v width, bytes) of SmolLM2-135M, Llama-3.2-1B, Llama-3-8B.
        let models = [(576, 1536, 960, 3_612_672), (2048, 8192, 3072, 58_720_256), (4096, 14336, 6144, 209_715_200)];
        for (h, inter, q, bytes) in models {
            assert_eq!(fold_extra_bytes(h, inter, q), bytes);
            assert_eq!(by_shape(h, inter, q), bytes);
        }
        // 135M (measured +0.3% / -1.0%) under the bound; 1B (not measured) and 8B (measured -37%) over it.
        assert!(models[0].3 <= FOLD_MAX_EXTRA_BYTES);
        assert!(models[1].3 > FOLD_MAX_EXTRA_BYTES && models[2].3 > FOLD_MAX_EXTRA_BYTES);
    }

    #[test]
    fn knobs_refuse_bad_values() {
        assert!(!fold_qkv(None).unwrap());
        assert!(!fold_qkv(Some("0")).unwrap());
        assert!(fold_qkv(Some(" 1 ")).unwrap());
        for bad in ["2", "yes", "-1", ""] {
            let e = fold_qkv(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_FOLD_QKV"), "{e}");
        }
        assert!(!screen_head(None).unwrap());
        assert!(!screen_head(Some("0")).unwrap());
        assert!(screen_head(Some(" 1 ")).unwrap());
        for bad in ["2", "yes", "-1", ""] {
            let e = screen_head(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_SCREEN_HEAD") && e.contains("0..=1"), "{bad:?}: {e}");
        }
        assert_eq!(knob("FERRUM_ATTN_SPLITS", None, 1, MAX_SPLITS).unwrap(), None);
        assert_eq!(knob("FERRUM_ATTN_SPLITS", Some(" 12 "), 1, MAX_SPLITS).unwrap(), Some(12));
        for bad in ["0", "65", "-1", "six", ""] {
            let e = knob("FERRUM_ATTN_SPLITS", Some(bad), 1, MAX_SPLITS).unwrap_err().to_string();
            assert!(e.contains("FERRUM_ATTN_SPLITS") && e.contains("1..=64"), "{bad:?}: {e}");
        }
        assert_eq!(gemv_split_k_cap(None).unwrap(), GEMV_MAX_KS);
        assert_eq!(gemv_split_k_cap(Some("1")).unwrap(), 1);
        assert_eq!(gemv_split_k_cap(Some("2")).unwrap(), 2);
        assert_eq!(gemv_split_k_cap(Some("8")).unwrap(), 8);
        for bad in ["3", "0", "16", "x"] {
            let e = gemv_split_k_cap(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_SPLIT_K"), "{bad:?}: {e}");
        }
        assert_eq!(gemv_variant(None).unwrap(), None);
        assert_eq!(gemv_variant(Some("0")).unwrap(), Some(0));
        assert_eq!(gemv_variant(Some("3")).unwrap(), Some(3));
        for bad in ["4", "-1", "two", ""] {
            let e = gemv_variant(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_VARIANT") && e.contains("0..=3"), "{bad:?}: {e}");
        }
    }

    /// The constants shared with the kernels match their `#define`s in the CUDA sources.
    #[test]
    fn constants_match_the_kernel_sources() {
        let define = |src: &str, name: &str| -> usize {
            let line = src.lines().find(|l| l.starts_with(&format!("#define {name} "))).expect(name);
            line.split_whitespace().nth(2).and_then(|v| v.parse().ok()).expect(name)
        };
        let attn = include_str!("../kernels/attention.cu");
        assert_eq!(define(attn, "ATTN_EARLY_ROWS"), ATTN_EARLY_ROWS);
        assert_eq!(define(attn, "ATTN_MAX_WARPS"), ATTN_MAX_WARPS as usize);
        assert_eq!(define(attn, "ATTN_MAX_SPLITS"), MAX_SPLITS);
        assert_eq!(define(attn, "ATTN_MAX_CLUSTER"), ATTN_MAX_CLUSTER);
        assert_eq!(define(attn, "ATTN_MAX_HD"), 256);
        assert_eq!(define(attn, "PF_WARPS"), PREFILL_WARPS as usize);
        assert_eq!(define(attn, "PF_BN"), PF_TILE_ROWS);
        assert_eq!(define(attn, "PF_MAX_STAGES"), ATTN_TC_MAX_STAGES);
        // The tensor-core kernels' head-dim switch is exactly PREFILL_HEAD_DIMS.
        let switch = attn.split("#define PF_HEAD_DIMS").nth(1).expect("PF_HEAD_DIMS");
        let switch = &switch[..switch.find("default:").expect("default")];
        let cases: Vec<usize> = switch
            .split("case ")
            .skip(1)
            .map(|c| c.split(':').next().and_then(|n| n.trim().parse().ok()).expect("case"))
            .collect();
        assert_eq!(cases, PREFILL_HEAD_DIMS);
        for hd in PREFILL_HEAD_DIMS {
            assert!(switch.contains(&format!("case {hd}: CALL({hd}); break;")), "head dim {hd}");
        }
        let gemv = include_str!("../kernels/gemv.cu");
        assert!(define(gemv, "GEMV_MAX_KS") >= GEMV_MAX_KS as usize);
    }

    #[test]
    fn warps_per_sm_and_carveout_knobs() {
        assert_eq!(gemv_warps_per_sm(None).unwrap(), GEMV_WARPS_PER_SM);
        // Lanes per row group: short rows without split-K only.
        assert_eq!(gemv_lanes_per_row(49152, 576, 1, None), 8); // SmolLM2-135M's LM head: 72 chunks
        assert_eq!(gemv_lanes_per_row(32000, 1536, 1, None), 16);
        assert_eq!(gemv_lanes_per_row(128256, 2048, 1, None), 32);
        assert_eq!(gemv_lanes_per_row(49152, 576, 2, None), 32);
        assert_eq!(gemv_lanes_per_row(49152, 580, 1, None), 32);
        assert_eq!(gemv_lanes_per_row(1536, 576, 1, None), 32); // a projection inside a layer
        assert_eq!(gemv_lanes_per_row(49152, 576, 1, Some(16)), 16);
        assert_eq!(gemv_lanes_per_row(49152, 576, 4, Some(16)), 32);
        assert_eq!(gemv_lanes_per_row(1536, 576, 1, Some(8)), 32);
        assert_eq!(gemv_lanes(None).unwrap(), None);
        assert_eq!(gemv_lanes(Some("16")).unwrap(), Some(16));
        for bad in ["12", "64", "x", "4"] {
            let e = gemv_lanes(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_LANES"), "{bad:?}: {e}");
        }
        assert_eq!(gemv_warps_per_sm(Some("16")).unwrap(), 16);
        for bad in ["0", "65", "x", ""] {
            let e = gemv_warps_per_sm(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_WARPS_PER_SM") && e.contains("1..=64"), "{bad:?}: {e}");
        }
        assert_eq!(smem_carveout(None).unwrap(), None);
        assert_eq!(attn_tc_carveout(Some("77")).unwrap(), Some(77));
        assert!(attn_tc_carveout(Some("101")).unwrap_err().to_string().contains("FERRUM_ATTN_TC_CARVEOUT"));
        assert_eq!(smem_carveout(Some("0")).unwrap(), Some(0));
        assert_eq!(smem_carveout(Some("100")).unwrap(), Some(100));
        for bad in ["101", "-1", "half"] {
            let e = smem_carveout(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_SMEM_CARVEOUT") && e.contains("0..=100"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn knob_text_refuses_values_that_are_not_utf8() {
        use std::env::VarError;
        assert_eq!(knob_text("FERRUM_X", Err(VarError::NotPresent)).unwrap(), None);
        assert_eq!(knob_text("FERRUM_X", Ok("3".into())).unwrap().as_deref(), Some("3"));
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let bad = std::ffi::OsString::from_vec(vec![0x66, 0xff, 0x6f]);
            let e = knob_text("FERRUM_X", Err(VarError::NotUnicode(bad))).unwrap_err().to_string();
            assert!(e.contains("FERRUM_X") && e.contains("UTF-8"), "{e}");
        }
    }

    #[test]
    fn head_dim_kernels_knob_and_source() {
        assert!(attn_head_dim_kernels(None).unwrap());
        assert!(attn_compact(None).unwrap());
        assert!(attn_compact(Some("1")).unwrap());
        assert!(!attn_compact(Some("0")).unwrap());
        assert!(attn_compact(Some("x")).unwrap_err().to_string().contains("FERRUM_ATTN_COMPACT"));
        assert!(attn_head_dim_kernels(Some("1")).unwrap());
        assert!(!attn_head_dim_kernels(Some("0")).unwrap());
        for bad in ["2", "-1", "", "on"] {
            let e = attn_head_dim_kernels(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_ATTN_HD_KERNELS") && e.contains("0..=1"), "{bad:?}: {e}");
        }
        // Every own head dim has its kernels in attention.cu, and is a supported head dim.
        let src = include_str!("../kernels/attention.cu");
        for hd in ATTN_OWN_HEAD_DIMS {
            assert!(crate::spec::SUPPORTED_HEAD_DIMS.contains(hd), "head dim {hd}");
            for s in ["f16, f16", "bf16, bf16"] {
                assert!(src.contains(&format!("FERRUM_ATTN_ROPE_HD({s}, {hd})")), "head dim {hd} ({s})");
            }
        }
    }

    #[test]
    fn half_prefetch_knob() {
        let none = HalfPrefetch::NONE;
        assert_eq!(half_prefetch(None).unwrap(), HALF_PREFETCH_DEFAULT);
        assert_eq!(HALF_PREFETCH_DEFAULT, HalfPrefetch { gateup: true, res: true, norm: true });
        assert_eq!(half_prefetch(Some("0")).unwrap(), none);
        assert_eq!(half_prefetch(Some("")).unwrap(), none);
        assert_eq!(half_prefetch(Some(" res , gateup,norm ")).unwrap(), HALF_PREFETCH_DEFAULT);
        assert_eq!(half_prefetch(Some("norm")).unwrap(), HalfPrefetch { norm: true, ..none });
        assert_eq!(half_prefetch(Some("gateup")).unwrap(), HalfPrefetch { gateup: true, ..none });
        for bad in ["gate", "all", "1", "res,o", "norm4"] {
            let e = half_prefetch(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_PF_HALF") && e.contains("unknown item"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn early_trigger_knob() {
        let none = EarlyTrigger::NONE;
        assert_eq!(early_trigger(None).unwrap(), EARLY_TRIGGER_DEFAULT);
        assert_eq!(EARLY_TRIGGER_DEFAULT, EarlyTrigger { o: true, down: true });
        assert_eq!(early_trigger(Some("0")).unwrap(), none);
        assert_eq!(early_trigger(Some("")).unwrap(), none);
        assert_eq!(early_trigger(Some(" o , down ")).unwrap(), EarlyTrigger { o: true, down: true });
        assert_eq!(early_trigger(Some("down")).unwrap(), EarlyTrigger { down: true, ..none });
        for bad in ["o,up", "all", "1"] {
            let e = early_trigger(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_EARLY_TRIGGER") && e.contains("unknown item"), "{bad:?}: {e}");
        }
    }

    /// The tensor-core decode attention's stage and early-tile knobs, its shared memory per
    /// launch, and the stage count fitted to a GPU's per-block limit.
    #[test]
    fn tensor_core_stage_knobs() {
        assert_eq!(attn_tc_stages(None).unwrap(), ATTN_TC_STAGES);
        assert_eq!(attn_tc_early(None).unwrap(), ATTN_TC_EARLY);
        assert!(!attn_tc_early(Some("0")).unwrap());
        assert!(attn_tc_early(Some("2")).unwrap_err().to_string().contains("FERRUM_ATTN_TC_EARLY"));
        assert_eq!(attn_tc_stages(Some("4")).unwrap(), 4);
        for bad in ["0", "1", "7", "", "deep"] {
            let e = attn_tc_stages(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_ATTN_TC_STAGES") && e.contains("2..=6"), "{bad}: {e}");
        }
        // Two stages at head dim 128 are the 34 KiB the kernel once reserved statically; the
        // most stages at the largest head dim stay under the 227 KiB a block may opt into.
        assert_eq!(attn_gqa_dyn_bytes(2, 128), 34816);
        assert!(attn_gqa_dyn_bytes(ATTN_TC_MAX_STAGES, *PREFILL_HEAD_DIMS.iter().max().unwrap()) <= 227 * 1024);
        // On a GPU whose blocks may opt into 99 KiB (sm_86 / sm_89 / sm_120) head dim 128 runs
        // 5 stages (85 KiB), not 6 (102 KiB); head dim 64 runs 6; never fewer than 2.
        let (h200, ada) = (227 * 1024, 99 * 1024);
        assert_eq!(attn_tc_stages_fitting(6, 128, h200), 6);
        assert_eq!(attn_tc_stages_fitting(6, 128, ada), 5);
        assert_eq!(attn_tc_stages_fitting(6, 64, ada), 6);
        assert_eq!(attn_tc_stages_fitting(5, 128, ada), 5);
        assert_eq!(attn_tc_stages_fitting(5, 128, 48 * 1024), 2);
        assert_eq!(attn_tc_stages_fitting(5, 128, 1024), 2);
        assert!(attn_gqa_dyn_bytes(2, 128) <= 48 * 1024);
    }

    #[test]
    fn tensor_core_threshold_knob() {
        assert_eq!(attn_tc_min_capacity(None).unwrap(), ATTN_TC_MIN_CAPACITY);
        assert_eq!(attn_tc_min_capacity(Some("1")).unwrap(), 1);
        assert_eq!(attn_tc_min_capacity(Some("100000000")).unwrap(), 100_000_000);
        for bad in ["0", "-1", "", "many", "1e6", "4294967296"] {
            let e = attn_tc_min_capacity(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_ATTN_TC_MIN_CAPACITY") && e.contains("1..=4294967295"), "{bad}: {e}");
        }
    }

    #[test]
    fn tensor_core_decode_only_for_long_caches_and_its_shapes() {
        let m = ATTN_TC_MIN_CAPACITY;
        assert!(attn_tensor_core(128, 32, 8, 8192, m)); // Llama-3-8B at 8k
        assert!(attn_tensor_core(64, 9, 3, m, m)); // SmolLM2-135M, exactly the threshold
        assert!(!attn_tensor_core(128, 32, 8, m - 1, m)); // short caches keep the fused kernel
        assert!(!attn_tensor_core(256, 8, 4, 8192, m)); // head dim outside the kernels' switch
        assert!(!attn_tensor_core(80, 8, 4, 8192, m));
        assert!(!attn_tensor_core(64, 32, 1, 8192, m)); // 32 q heads per KV head: > 16 rows
        assert!(attn_tensor_core(64, 16, 1, 8192, m));
        assert!(!attn_tensor_core(64, 6, 4, 8192, m)); // not a whole group
        assert!(!attn_tensor_core(64, 4, 0, 8192, m));
        assert!(!attn_tensor_core(128, 32, 8, 1 << 20, usize::MAX)); // the knob's "never"
    }

    #[test]
    fn gemv_tuning_keeps_the_balanced_launches() {
        // The 135M down projection on 132 multiprocessors: 144 blocks of 4 outputs load a
        // multiprocessor with up to 8, 288 blocks of 2 with up to 6, 4-row warps up to 8.
        assert_eq!(gemv_sm_load(144, 4, H200_SMS), 8);
        assert_eq!(gemv_sm_load(288, 2, H200_SMS), 6);
        assert_eq!(gemv_balanced(&[(144, 4), (288, 2), (72, 8), (144, 4)], H200_SMS), [false, true, false, false]);
        // Many waves: every variant loads the multiprocessors alike, so all are timed (the
        // Llama-3-8B gate|up: 14336 outputs).
        let gu = [(1792, 8), (3584, 4), (896, 16), (1792, 8)];
        assert_eq!(gemv_balanced(&gu, H200_SMS), [true; 4]);
        // Its LM head: 4008 blocks of 32 load the busiest multiprocessor with 992 outputs,
        // within the slack of the others' 976.
        let head = [(8016, 16), (16032, 8), (4008, 32), (8016, 16)];
        assert_eq!(head.map(|(b, p)| gemv_sm_load(b, p, H200_SMS)), [976, 976, 992, 976]);
        assert_eq!(gemv_balanced(&head, H200_SMS), [true; 4]);
        // The Llama-3-8B TP2 gate|up shard (7168 outputs): the 4-row warps of 8-warp blocks
        // load up to 64, the others 56 (14% over): within the slack, so all are timed.
        let gu2 = [(896, 8), (1792, 4), (448, 16), (896, 8)];
        assert_eq!(gu2.map(|(b, p)| gemv_sm_load(b, p, H200_SMS)), [56, 56, 64, 56]);
        assert_eq!(gemv_balanced(&gu2, H200_SMS), [true; 4]);
        // Past the slack: 121% of the least is out, 120% in.
        assert_eq!(gemv_balanced(&[(132, 100), (132, 120), (132, 121)], H200_SMS), [true, true, false]);
        // One candidate, or none.
        assert_eq!(gemv_balanced(&[(1, 1)], H200_SMS), [true]);
        assert!(gemv_balanced(&[], H200_SMS).is_empty());
        assert_eq!(gemv_sm_load(5, 3, 0), 15);
    }

    #[test]
    fn split_k_respects_its_caps() {
        // SmolLM2-135M: 576 columns are 2 whole stripes of 32 chunks, so at most 2.
        assert_eq!(gemv_split_k(576, 576, H200_SMS, 4), 2);
        // 1536 columns: 6 stripes, the cap of 4 wins.
        assert_eq!(gemv_split_k(576, 1536, H200_SMS, 4), 4);
        // The knob caps it (FERRUM_GEMV_SPLIT_K); 0 acts as 1.
        assert_eq!(gemv_split_k(576, 1536, H200_SMS, 2), 2);
        assert_eq!(gemv_split_k(576, 1536, H200_SMS, 1), 1);
        assert_eq!(gemv_split_k(576, 1536, H200_SMS, 0), 1);
        // Fewer than 256 columns: one stripe, no split.
        assert_eq!(gemv_split_k(64, 128, H200_SMS, 4), 1);
        // A cap of 8 (the knob's largest): Llama-3.2-1B's down projection splits 8 ways, its
        // o projection (8 stripes: one a warp at 8) stays at 4.
        assert_eq!(gemv_split_k(2048, 8192, H200_SMS, 8), 8);
        assert_eq!(gemv_split_k(2048, 2048, H200_SMS, 8), 4);
        // One stripe a warp (FERRUM_GEMV_KS_EXACT): SmolLM2-135M's 72 and 192 chunks split 3
        // and 6 ways; its gate|up (3072 weight rows) would exceed the warp target at 3; a shape
        // that does not split, or whose stripes need more warps than the knob or the target
        // allow, keeps its split.
        let exact = |rows, cols, max| gemv_split_k_exact(rows, cols, H200_SMS, GEMV_MAX_KS, GEMV_WARPS_PER_SM, max);
        assert_eq!(exact(960, 576, 8), 3);
        assert_eq!(exact(576, 576, 8), 3);
        assert_eq!(exact(3072, 576, 8), 2);
        assert_eq!(exact(576, 1536, 8), 6);
        assert_eq!(exact(576, 1536, 5), 4);
        assert_eq!(exact(576, 1536, 0), 4);
        assert_eq!(exact(960, 576, 1), 2);
        assert_eq!(exact(49152, 576, 8), 1);
        // Llama-3.2-1B: qkv and o would need 8 (12288 and 8192 warps), down already splits 8.
        assert_eq!(exact(3072, 2048, 8), 4);
        assert_eq!(exact(2048, 2048, 8), 4);
        assert_eq!(exact(2048, 8192, 8), 8);
        assert_eq!(exact(64, 128, 8), 1);
        // The split-K cap (FERRUM_GEMV_SPLIT_K) bounds it too.
        assert_eq!(gemv_split_k_exact(576, 1536, H200_SMS, 4, GEMV_WARPS_PER_SM, 8), 4);
        assert_eq!(gemv_split_k_exact(576, 576, H200_SMS, 4, GEMV_WARPS_PER_SM, 8), 3);
        // The tuning's pick: the fewest blocks among the launches within 1% of the fastest
        // (synthetic timings: 0.8% apart is a tie, 1.5% and 3% are not).
        let t = GEMV_TIE_PERMILLE;
        assert_eq!(gemv_pick(&[(1.6128, 480), (1.6117, 240)], t), Some(1));
        assert_eq!(gemv_pick(&[(1.6117, 480), (1.6128, 240)], t), Some(1));
        assert_eq!(gemv_pick(&[(1.6149, 480), (1.6277, 240)], t), Some(1));
        assert_eq!(gemv_pick(&[(1.6085, 240), (1.6326, 120)], t), Some(0));
        assert_eq!(gemv_pick(&[(1.6085, 240), (1.6565, 120)], t), Some(0));
        assert_eq!(gemv_pick(&[(1.50, 288), (1.60, 144)], t), Some(0));
        assert_eq!(gemv_pick(&[(2.0, 100), (2.0, 100)], t), Some(0));
        assert_eq!(gemv_pick(&[], t), None);
        // Off (0): the fastest alone; an exact tie still goes to the fewest blocks.
        assert_eq!(gemv_pick(&[(1.6117, 480), (1.6117, 240)], 0), Some(1));
        assert_eq!(gemv_pick(&[(1.6117, 480), (1.6128, 240)], 0), Some(0));
        assert_eq!(gemv_pick(&[(1.6128, 480), (1.6117, 240)], 0), Some(1));
        assert_eq!(graph_steps(None).unwrap(), GRAPH_STEPS);
        assert_eq!(check_graph_steps(1).unwrap(), 1);
        assert_eq!(check_graph_steps(MAX_GRAPH_STEPS).unwrap(), MAX_GRAPH_STEPS);
        for bad in [0, MAX_GRAPH_STEPS + 1] {
            assert!(check_graph_steps(bad).unwrap_err().to_string().contains("steps per graph (1..=32)"), "{bad}");
        }
        assert_eq!(graph_steps(Some(" 8 ")).unwrap(), 8);
        for bad in ["0", "33", "-1", "", "eight"] {
            let e = graph_steps(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GRAPH_STEPS") && e.contains("1..=32"), "{bad}: {e}");
        }
        assert_eq!(gemv_tie_permille(None).unwrap(), GEMV_TIE_PERMILLE);
        assert_eq!(gemv_tie_permille(Some("0")).unwrap(), 0);
        for bad in ["101", "-1", "", "half"] {
            let e = gemv_tie_permille(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_TIE") && e.contains("0..=100"), "{bad}: {e}");
        }
        assert_eq!(gemv_ks_exact(None).unwrap(), GEMV_MAX_KS);
        assert_eq!(gemv_ks_exact(Some("0")).unwrap(), 0);
        assert_eq!(gemv_ks_exact(Some("6")).unwrap(), 6);
        assert!(gemv_ks_exact(Some("9")).unwrap_err().to_string().contains("FERRUM_GEMV_KS_EXACT"));
        // Always a power of two in 1..=GEMV_MAX_KS, whatever the cap.
        for rows in [1, 7, 100, 1000, 5000, 100_000] {
            for cols in [8, 256, 1000, 4096, 20_000] {
                let ks = gemv_split_k(rows, cols, H200_SMS, u32::MAX);
                assert!(ks.is_power_of_two() && ks <= GEMV_MAX_KS, "{rows}x{cols}: {ks}");
            }
        }
    }
}
