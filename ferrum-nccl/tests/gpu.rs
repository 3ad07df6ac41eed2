//! GPU tests of ferrum-nccl (ignored by default: they need CUDA GPUs and libnccl).
//!
//! Run on a GPU machine, one test at a time (NCCL communicators of parallel tests would share
//! the GPUs, and the environment is set once):
//!
//! ```text
//! NCCL_NVLS_ENABLE=0 cargo test -p ferrum-nccl --features cuda --test gpu -- --ignored --test-threads=1 --nocapture
//! ```
//!
//! They use every visible GPU (1 is enough; 2+ also exercise the real reduction and the
//! abort of a collective blocked on a peer). Each prints what it measured.
#![cfg(feature = "cuda")]

use ferrum_nccl::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ferrum_nccl::{group, nccl_version, Error, NcclRank, Rendezvous, RendezvousOptions};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sets `NCCL_NVLS_ENABLE=0` (before any NCCL call) and returns the visible GPU count.
fn setup() -> usize {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // Tests run with --test-threads=1; the variable is set before NCCL reads it.
    ONCE.call_once(|| std::env::set_var("NCCL_NVLS_ENABLE", "0"));
    assert!(ferrum_nccl::nvls_disabled());
    let n = CudaContext::device_count().expect("CUDA driver") as usize;
    assert!(n >= 1, "no CUDA GPU visible");
    match nccl_version() {
        Ok(v) => println!("NCCL {v}, {n} GPU(s) visible"),
        Err(e) => panic!("NCCL unavailable: {e}"),
    }
    n
}

/// Deterministic per-rank pseudo-random values in `-range..=range`.
fn data(rank: usize, len: usize, range: i32) -> Vec<i32> {
    let mut s = 0x9E37_79B9u32 ^ (rank as u32).wrapping_mul(0x85EB_CA6B);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % (2 * range as u32 + 1)) as i32 - range
        })
        .collect()
}

fn ranks_and_streams(n: usize) -> (Vec<NcclRank>, Vec<Arc<CudaStream>>) {
    let ordinals: Vec<usize> = (0..n).collect();
    let t = Instant::now();
    let ranks = NcclRank::init_all(&ordinals).expect("init_all");
    println!("init_all over {n} GPU(s): {:?}", t.elapsed());
    let streams = ranks.iter().map(|r| r.context().new_stream().expect("stream")).collect();
    (ranks, streams)
}

/// All-reduces `host[r]` on every rank (one thread, NCCL group) and returns every rank's result.
fn all_reduce<T>(ranks: &[NcclRank], streams: &[Arc<CudaStream>], host: &[Vec<T>]) -> Vec<Vec<T>>
where
    T: ferrum_nccl::NcclElement + Copy + Default,
{
    let mut bufs: Vec<CudaSlice<T>> = streams.iter().zip(host).map(|(s, h)| s.clone_htod(h).unwrap()).collect();
    let refs: Vec<&NcclRank> = ranks.iter().collect();
    group(&refs, |g| {
        for (i, buf) in bufs.iter_mut().enumerate() {
            g.all_reduce_sum_in_place(i, buf, &streams[i])?;
        }
        Ok(())
    })
    .expect("grouped all-reduce");
    streams.iter().zip(&bufs).map(|(s, b)| s.clone_dtoh(b).unwrap()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn init_all_reports_ranks() {
    let n = setup();
    let (ranks, _streams) = ranks_and_streams(n);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r.rank(), i);
        assert_eq!(r.world_size(), n);
        assert_eq!(r.device_ordinal(), i);
        assert!(!r.is_aborted());
        r.check_async_error().unwrap();
    }
    assert!(matches!(NcclRank::init_all(&[0, 0]), Err(Error::InvalidArgument(_))));
    assert!(matches!(NcclRank::init_all(&[n + 7]), Err(Error::Unavailable(_))));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn all_reduce_f32_is_exact() {
    let n = setup();
    let (ranks, streams) = ranks_and_streams(n);
    let len = 4097;
    let ints: Vec<Vec<i32>> = (0..n).map(|r| data(r, len, 1000)).collect();
    let host: Vec<Vec<f32>> = ints.iter().map(|v| v.iter().map(|&x| x as f32).collect()).collect();
    let want: Vec<f32> = (0..len).map(|i| ints.iter().map(|v| v[i]).sum::<i32>() as f32).collect();
    let got = all_reduce(&ranks, &streams, &host);
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g, &want, "rank {r}");
    }
    println!("f32 all-reduce of {len} elements over {n} rank(s): exact");
}

fn check_half<T>(n: usize, name: &str, eps: f64, to: fn(f32) -> T, from: fn(T) -> f32)
where
    T: ferrum_nccl::NcclElement + Copy + Default,
{
    let (ranks, streams) = ranks_and_streams(n);
    let len = 8191;
    let host: Vec<Vec<T>> =
        (0..n).map(|r| data(r, len, 512).into_iter().map(|x| to(x as f32 / 256.0)).collect()).collect();
    let got = all_reduce(&ranks, &streams, &host);
    let mut max_err = 0f64;
    for i in 0..len {
        let exact: f64 = host.iter().map(|v| f64::from(from(v[i]))).sum();
        let mag: f64 = host.iter().map(|v| f64::from(from(v[i])).abs()).sum();
        // Each of the (n - 1) partial sums, and the final value, is rounded once.
        let tol = n as f64 * eps * mag.max(exact.abs()) + 1e-6;
        for (r, g) in got.iter().enumerate() {
            let err = (f64::from(from(g[i])) - exact).abs();
            max_err = max_err.max(err);
            assert!(err <= tol, "{name} rank {r} element {i}: got {}, exact {exact}, tol {tol}", from(g[i]));
        }
        // Every rank holds the same result.
        for g in &got[1..] {
            assert_eq!(from(g[i]).to_bits(), from(got[0][i]).to_bits(), "{name}: ranks disagree at {i}");
        }
    }
    println!("{name} all-reduce of {len} elements over {n} rank(s): max abs error {max_err:.3e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn all_reduce_f16_within_tolerance() {
    let n = setup();
    check_half::<f16>(n, "f16", 2f64.powi(-11), f16::from_f32, f16::to_f32);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn all_reduce_bf16_within_tolerance() {
    let n = setup();
    check_half::<bf16>(n, "bf16", 2f64.powi(-8), bf16::from_f32, bf16::to_f32);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn all_gather_concatenates_ranks() {
    let n = setup();
    let (ranks, streams) = ranks_and_streams(n);
    let count = 1000;
    let sends: Vec<CudaSlice<u32>> = streams
        .iter()
        .enumerate()
        .map(|(r, s)| s.clone_htod(&(0..count).map(|i| (r * 1_000_000 + i) as u32).collect::<Vec<_>>()).unwrap())
        .collect();
    let mut recvs: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count * n).unwrap()).collect();
    // Too small a receive buffer is refused before NCCL sees it.
    let mut small: CudaSlice<u32> = streams[0].alloc_zeros(count * n - 1).unwrap();
    assert!(matches!(ranks[0].all_gather(&sends[0], &mut small, &streams[0]), Err(Error::InvalidArgument(_))));
    let refs: Vec<&NcclRank> = ranks.iter().collect();
    group(&refs, |g| {
        for (i, recv) in recvs.iter_mut().enumerate() {
            g.all_gather(i, &sends[i], recv, &streams[i])?;
        }
        Ok(())
    })
    .unwrap();
    let want: Vec<u32> = (0..n).flat_map(|r| (0..count).map(move |i| (r * 1_000_000 + i) as u32)).collect();
    for (r, (s, b)) in streams.iter().zip(&recvs).enumerate() {
        assert_eq!(s.clone_dtoh(b).unwrap(), want, "rank {r}");
    }
    println!("all-gather of {count} u32 per rank over {n} rank(s): exact");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn init_rank_through_file_rendezvous_world_of_one() {
    setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nccl.id");
    let opts = RendezvousOptions { timeout: Duration::from_secs(30), ..Default::default() };
    let rank = NcclRank::init_rank_rendezvous_on(0, 0, 1, &Rendezvous::File(path.clone()), &opts).unwrap();
    assert_eq!((rank.rank(), rank.world_size()), (0, 1));
    // The id file was written and reads back as an id.
    let bytes = std::fs::read(&path).unwrap();
    ferrum_nccl::rendezvous::decode_id_file(&bytes).unwrap();
    let stream = rank.context().new_stream().unwrap();
    let host: Vec<f32> = data(0, 513, 100).into_iter().map(|x| x as f32).collect();
    let mut buf = stream.clone_htod(&host).unwrap();
    rank.all_reduce_sum_in_place(&mut buf, &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
    println!("init_rank (world 1) via {}: ok", path.display());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn init_rank_one_thread_per_gpu_through_tcp_rendezvous() {
    let n = setup();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rdv = Rendezvous::Tcp(format!("127.0.0.1:{port}"));
    let opts = RendezvousOptions { timeout: Duration::from_secs(60), ..Default::default() };
    let len = 1025;
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let rdv = rdv.clone();
            std::thread::spawn(move || -> Result<Vec<f32>, Error> {
                let rank = NcclRank::init_rank_rendezvous_on(r, r, n, &rdv, &opts)?;
                let stream =
                    rank.context().new_stream().map_err(|e| Error::Cuda { op: "stream", msg: e.to_string() })?;
                let host: Vec<f32> = data(r, len, 100).into_iter().map(|x| x as f32).collect();
                let mut buf = stream.clone_htod(&host).unwrap();
                rank.all_reduce_sum_in_place(&mut buf, &stream)?;
                Ok(stream.clone_dtoh(&buf).unwrap())
            })
        })
        .collect();
    let want: Vec<f32> = (0..len).map(|i| (0..n).map(|r| data(r, len, 100)[i]).sum::<i32>() as f32).collect();
    for (r, t) in threads.into_iter().enumerate() {
        assert_eq!(t.join().unwrap().unwrap(), want, "rank {r}");
    }
    println!("init_rank x{n} (one thread per GPU) via tcp:127.0.0.1:{port}: all-reduce exact");
}

/// Named `zz_` so that it runs last with `--test-threads=1`: it aborts a collective that is
/// running on the GPU, the one test that could leave a device's context unusable if NCCL or the
/// driver misbehaved.
#[test]
#[ignore = "needs a CUDA GPU"]
fn zz_abort_makes_operations_fail_instead_of_hanging() {
    let n = setup();
    // World of one: abort, then every operation is an error.
    {
        let ranks = NcclRank::init_all(&[0]).unwrap();
        let rank = &ranks[0];
        let stream = rank.context().new_stream().unwrap();
        let mut buf = stream.alloc_zeros::<f32>(64).unwrap();
        rank.all_reduce_sum_in_place(&mut buf, &stream).unwrap();
        // Abort from another thread through a handle.
        let handle = rank.abort_handle();
        std::thread::spawn(move || handle.abort("test abort")).join().unwrap();
        assert!(rank.is_aborted());
        let err = rank.all_reduce_sum_in_place(&mut buf, &stream).unwrap_err();
        assert!(matches!(err, Error::Aborted { .. }), "{err}");
        println!("after abort: {err}");
        assert!(matches!(rank.check_async_error(), Err(Error::Aborted { .. })));
        rank.abort("again"); // idempotent
        stream.synchronize().unwrap();
    }
    if n < 2 {
        println!("blocked-collective abort: skipped (needs 2 GPUs, {n} visible)");
        return;
    }
    // Two ranks or more: rank 1 enters an all-reduce that rank 0 never joins; aborting rank 1
    // from another thread must make its stream finish.
    let (ranks, streams) = ranks_and_streams(n);
    // Warm up (NCCL connects peers lazily at the first collective).
    let host: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0; 256]).collect();
    all_reduce(&ranks, &streams, &host);
    let mut buf = streams[1].alloc_zeros::<f32>(256).unwrap();
    ranks[1].all_reduce_sum_in_place(&mut buf, &streams[1]).unwrap();
    let handle = ranks[1].abort_handle();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        handle.abort("peer never joined (test)");
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let s1 = streams[1].clone();
    let t = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(s1.synchronize());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(r) => println!("blocked all-reduce returned {:?} after abort, {:?} after launch", r, t.elapsed()),
        Err(_) => panic!("stream still blocked 60 s after ncclCommAbort"),
    }
    aborter.join().unwrap();
    assert!(matches!(ranks[1].all_reduce_sum_in_place(&mut buf, &streams[1]), Err(Error::Aborted { .. })));
    for r in &ranks {
        r.abort("test done");
    }
}
