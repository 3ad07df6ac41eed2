//! `ferrum bench --all-reduce`: the latency of one decode-sized NCCL all-reduce over `--tp`
//! GPUs, inside a CUDA graph (as the decode step runs it) and enqueued eagerly.
//!
//! Each rank (one thread per GPU) captures `PER_GRAPH` back-to-back in-place all-reduces of
//! `--hidden` elements into one graph, replays it (warm-up, then `REPLAYS` timed replays
//! between two CUDA events) and reports the time per all-reduce; the median over the ranks'
//! figures is printed.
use anyhow::{Context, Result};
use serde::Serialize;

use ferrum_graph::cudarc::driver::sys::CUevent_flags;
use ferrum_graph::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use ferrum_graph::CapturedGraph;
use ferrum_nccl::{AbortHandle, NcclElement, NcclRank};
use ferrum_tp::{AbortableBarrier, GroupBarrier};
use std::sync::Arc;

const PER_GRAPH: usize = 100;
const REPLAYS: usize = 20;

#[derive(Serialize, Debug)]
pub struct AllReduceReport {
    pub ranks: usize,
    pub elements: usize,
    pub dtype: String,
    pub bytes: usize,
    /// µs per all-reduce inside a graph (rank median).
    pub graph_us: f64,
    /// µs per all-reduce enqueued eagerly, back to back (rank median).
    pub eager_us: f64,
}

fn time_rank<T: NcclElement + DeviceRepr + ValidAsZeroBits>(
    rank: &NcclRank,
    n: usize,
    barrier: &GroupBarrier,
) -> Result<(f64, f64)> {
    let ctx = rank.context().clone();
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
        Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / (REPLAYS * count) as f64)
    };
    // NCCL connects peers at a size's first collective, which cannot happen while capturing.
    rank.all_reduce_sum_in_place(&mut buf, &stream)?;
    stream.synchronize()?;
    let graph = CapturedGraph::capture(&stream, |s| {
        for _ in 0..PER_GRAPH {
            rank.all_reduce_sum_in_place(&mut buf, s.stream())?;
        }
        Ok::<_, ferrum_nccl::Error>(())
    })
    .context("capturing the all-reduces")?;
    graph.upload(&stream)?;
    // The graph holds NCCL kernels: launch it only while the communicator is live (a failing
    // peer aborts every communicator from its own thread).
    let graph_us = timed(&mut || Ok(rank.while_live(|| graph.replay(&stream))??), PER_GRAPH)?;
    drop(graph);
    let eager_us = timed(
        &mut || {
            for _ in 0..PER_GRAPH {
                rank.all_reduce_sum_in_place(&mut buf, &stream)?;
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

fn run_dtype<T: NcclElement + DeviceRepr + ValidAsZeroBits>(
    ordinals: &[usize],
    n: usize,
    name: &str,
) -> Result<AllReduceReport> {
    let ranks = NcclRank::init_all(ordinals)?;
    let aborts: Vec<AbortHandle> = ranks.iter().map(NcclRank::abort_handle).collect();
    let barrier = GroupBarrier::with_parties(ranks.len());
    // A failing rank releases the others: the barrier is aborted (peers waiting in it return)
    // and so is every communicator (peers blocked in a collective on the GPU return).
    let fail = |e: anyhow::Error| {
        barrier.abort();
        for a in &aborts {
            a.abort("a rank of the all-reduce benchmark failed");
        }
        e
    };
    let results: Vec<Result<(f64, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|r| {
                s.spawn(|| {
                    // A panic must release the peers too, before this thread ends.
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| time_rank::<T>(r, n, &barrier))) {
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
        ranks: ordinals.len(),
        elements: n,
        dtype: name.into(),
        bytes: n * std::mem::size_of::<T>(),
        graph_us: median(results.iter().map(|r| r.0).collect()),
        eager_us: median(results.iter().map(|r| r.1).collect()),
    })
}

/// Measures f32 (what ferrum's decode reduces) and bf16 all-reduces of `n` elements.
pub fn run(first: usize, tp: usize, n: usize, json: bool) -> Result<()> {
    if tp < 2 {
        anyhow::bail!("--all-reduce needs --tp 2 or more");
    }
    let ordinals: Vec<usize> = (first..first + tp).collect();
    let reports = vec![run_dtype::<f32>(&ordinals, n, "f32")?, run_dtype::<half::bf16>(&ordinals, n, "bf16")?];
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        for r in &reports {
            println!(
                "all-reduce {} × {} ({} B) over {} GPUs: {:.2} µs in a graph, {:.2} µs eager",
                r.elements, r.dtype, r.bytes, r.ranks, r.graph_us, r.eager_us
            );
        }
    }
    Ok(())
}
