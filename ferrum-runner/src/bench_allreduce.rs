//! `ferrum bench --all-reduce`: the latency of one decode-sized all-reduce over `--tp` GPUs,
//! inside a CUDA graph (as the decode step runs it) and enqueued eagerly: NCCL (f32 and bf16)
//! and ferrum-cuda's one-shot peer all-reduce (f32, what the decode sums, and bf16).
//!
//! Each rank (one thread per GPU) captures `PER_GRAPH` back-to-back in-place all-reduces of
//! `--hidden` elements into one graph, replays it (warm-up, then `REPLAYS` timed replays
//! between two CUDA events) and reports the time per all-reduce; the median over the ranks'
//! figures is printed.
use anyhow::{Context, Result};
use serde::Serialize;

use ferrum_cuda::peer::{peer_group, PeerElement, PeerRank, DEFAULT_PEER_TIMEOUT};
use ferrum_graph::cudarc::driver::sys::CUevent_flags;
use ferrum_graph::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use ferrum_graph::CapturedGraph;
use ferrum_nccl::{NcclElement, NcclRank};
use ferrum_tp::{AbortableBarrier, GroupBarrier};
use std::sync::Arc;

const PER_GRAPH: usize = 100;
const REPLAYS: usize = 20;

#[derive(Serialize, Debug)]
pub struct AllReduceReport {
    /// `nccl` or `peer` (the one-shot kernel).
    pub algo: String,
    pub ranks: usize,
    pub elements: usize,
    pub dtype: String,
    pub bytes: usize,
    /// µs per all-reduce inside a graph (rank median).
    pub graph_us: f64,
    /// µs per all-reduce enqueued eagerly, back to back (rank median).
    pub eager_us: f64,
}

/// One rank of an all-reduce under test.
trait RankReduce<T>: Sync {
    fn context(&self) -> Arc<CudaContext>;
    /// Sums `buf` in place over the ranks, on `s`.
    fn reduce(&self, buf: &mut CudaSlice<T>, s: &Arc<CudaStream>) -> Result<()>;
    /// Launches a graph of such sums.
    fn replay(&self, g: &CapturedGraph, s: &Arc<CudaStream>) -> Result<()>;
    /// After the work was waited for: did every sum complete?
    fn check(&self) -> Result<()>;
    /// Releases the peers of a failed rank.
    fn abort(&self);
}

impl<T: NcclElement> RankReduce<T> for NcclRank {
    fn context(&self) -> Arc<CudaContext> {
        NcclRank::context(self).clone()
    }
    fn reduce(&self, buf: &mut CudaSlice<T>, s: &Arc<CudaStream>) -> Result<()> {
        Ok(self.all_reduce_sum_in_place(buf, s)?)
    }
    fn replay(&self, g: &CapturedGraph, s: &Arc<CudaStream>) -> Result<()> {
        // The graph holds NCCL kernels: launch it only while the communicator is live (a
        // failing peer aborts every communicator from its own thread).
        Ok(self.while_live(|| g.replay(s))??)
    }
    fn check(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self) {
        self.abort_handle().abort("a rank of the all-reduce benchmark failed");
    }
}

impl<T: PeerElement> RankReduce<T> for PeerRank {
    fn context(&self) -> Arc<CudaContext> {
        PeerRank::context(self).clone()
    }
    fn reduce(&self, buf: &mut CudaSlice<T>, s: &Arc<CudaStream>) -> Result<()> {
        let n = buf.len();
        Ok(self.all_reduce_sum_in_place(buf, n, s)?)
    }
    fn replay(&self, g: &CapturedGraph, s: &Arc<CudaStream>) -> Result<()> {
        Ok(g.replay(s)?)
    }
    fn check(&self) -> Result<()> {
        Ok(self.handle().check()?)
    }
    fn abort(&self) {
        self.handle().abort();
    }
}

fn time_rank<T: DeviceRepr + ValidAsZeroBits, R: RankReduce<T>>(
    rank: &R,
    n: usize,
    barrier: &GroupBarrier,
) -> Result<(f64, f64)> {
    let ctx = rank.context();
    // SAFETY: every buffer below is used on one stream only, so cudarc's cross-stream event
    // tracking is not needed (and graph capture requires it off).
    unsafe { ctx.disable_event_tracking() };
    let stream: Arc<CudaStream> = ctx.new_stream().context("creating a stream")?;
    let mut buf: CudaSlice<T> = stream.alloc_zeros::<T>(n).context("allocating the buffer")?;
    let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).context("creating an event");
    let (e0, e1) = (ev()?, ev()?);
    let timed = |run: &mut dyn FnMut() -> Result<()>, count: usize| -> Result<f64> {
        barrier.wait().map_err(|_| anyhow::anyhow!("another rank failed"))?;
        run()?; // warm-up
        stream.synchronize()?;
        barrier.wait().map_err(|_| anyhow::anyhow!("another rank failed"))?;
        e0.record(&stream)?;
        for _ in 0..REPLAYS {
            run()?;
        }
        e1.record(&stream)?;
        e1.synchronize()?;
        rank.check()?;
        Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / (REPLAYS * count) as f64)
    };
    // NCCL connects peers at a size's first collective, which cannot happen while capturing.
    rank.reduce(&mut buf, &stream)?;
    stream.synchronize()?;
    let graph = CapturedGraph::capture(&stream, |s| {
        for _ in 0..PER_GRAPH {
            rank.reduce(&mut buf, s.stream())?;
        }
        Ok::<_, anyhow::Error>(())
    })
    .context("capturing the all-reduces")?;
    graph.upload(&stream)?;
    let graph_us = timed(&mut || rank.replay(&graph, &stream), PER_GRAPH)?;
    drop(graph);
    let eager_us = timed(
        &mut || {
            for _ in 0..PER_GRAPH {
                rank.reduce(&mut buf, &stream)?;
            }
            Ok(())
        },
        PER_GRAPH,
    )?;
    Ok((graph_us, eager_us))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `ranks` (one thread each); a failing rank aborts the others.
fn run_ranks<T: DeviceRepr + ValidAsZeroBits, R: RankReduce<T>>(
    ranks: &[R],
    n: usize,
    algo: &str,
    name: &str,
) -> Result<AllReduceReport> {
    let barrier = GroupBarrier::with_parties(ranks.len());
    // A failing rank releases the others: the barrier is aborted (peers waiting in it return)
    // and so is every rank's collective (peers blocked in one on the GPU return).
    let fail = |e: anyhow::Error| {
        barrier.abort();
        for r in ranks {
            r.abort();
        }
        e
    };
    let results: Vec<Result<(f64, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|r| {
                s.spawn(|| {
                    // A panic must release the peers too, before this thread ends.
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| time_rank::<T, R>(r, n, &barrier))) {
                        Ok(r) => r.map_err(fail),
                        Err(_) => Err(fail(anyhow::anyhow!("a rank panicked"))),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(AllReduceReport {
        algo: algo.into(),
        ranks: ranks.len(),
        elements: n,
        dtype: name.into(),
        bytes: n * std::mem::size_of::<T>(),
        graph_us: median(results.iter().map(|r| r.0).collect()),
        eager_us: median(results.iter().map(|r| r.1).collect()),
    })
}

fn run_nccl<T: NcclElement + DeviceRepr + ValidAsZeroBits>(
    ordinals: &[usize],
    n: usize,
    name: &str,
) -> Result<AllReduceReport> {
    let ranks = NcclRank::init_all(ordinals)?;
    run_ranks::<T, NcclRank>(&ranks, n, "nccl", name)
}

fn run_peer(ordinals: &[usize], n: usize) -> Result<Vec<AllReduceReport>> {
    let ranks = peer_group(ordinals, n, DEFAULT_PEER_TIMEOUT)?;
    Ok(vec![
        run_ranks::<f32, PeerRank>(&ranks, n, "peer", "f32")?,
        run_ranks::<half::bf16, PeerRank>(&ranks, n, "peer", "bf16")?,
    ])
}

/// Measures NCCL f32 (what ferrum's decode reduces without peer access) and bf16 all-reduces
/// of `n` elements, and the one-shot peer all-reduce of `n` f32 and bf16.
pub fn run(first: usize, tp: usize, n: usize, json: bool) -> Result<()> {
    if tp < 2 {
        anyhow::bail!("--all-reduce needs --tp 2 or more");
    }
    let ordinals: Vec<usize> = (first..first + tp).collect();
    let mut reports = vec![run_nccl::<f32>(&ordinals, n, "f32")?, run_nccl::<half::bf16>(&ordinals, n, "bf16")?];
    // The NCCL figures are printed even when the GPUs lack peer access.
    let peer = match run_peer(&ordinals, n) {
        Ok(r) => {
            reports.extend(r);
            Ok(())
        }
        Err(e) => Err(e),
    };
    // One write of the whole report: a closed stdout (`| head`) is a quiet end, not a panic.
    let text = if json {
        serde_json::to_string_pretty(&reports)? + "\n"
    } else {
        reports
            .iter()
            .map(|r| {
                format!(
                    "all-reduce ({}) {} × {} ({} B) over {} GPUs: {:.2} µs in a graph, {:.2} µs eager\n",
                    r.algo, r.elements, r.dtype, r.bytes, r.ranks, r.graph_us, r.eager_us
                )
            })
            .collect()
    };
    crate::bench::print_out(&text)?;
    peer.context("the one-shot peer all-reduce")
}
