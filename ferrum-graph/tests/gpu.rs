//! GPU tests of ferrum-graph (ignored by default: they need a CUDA GPU, the driver and NVRTC).
//!
//! ```text
//! cargo test -p ferrum-graph --features cuda --test gpu -- --ignored --test-threads=1 --nocapture
//! ```
//!
//! Each test prints what it measured. Kernels are compiled at test time with NVRTC.
#![cfg(feature = "cuda")]
#![allow(clippy::undocumented_unsafe_blocks)] // test launches: every kernel's extents are set up right above it

use ferrum_graph::cudarc::driver::sys::CUstreamCaptureStatus;
use ferrum_graph::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use ferrum_graph::{CapturedGraph, DecodeGraphCache, GraphError, StepParams, StepValues};
use std::sync::Arc;
use std::time::Instant;

const SRC: &str = r#"
extern "C" __global__ void scale_add(const float* x, const unsigned* p, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * (float)p[0] + (float)i;          // p[0] = token
}
extern "C" __global__ void shift(float* y, const unsigned* p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] * 0.5f + (float)p[1] - (float)p[2]; // p[1] = position, p[2] = kv_len
}
extern "C" __global__ void accumulate(const unsigned* p, unsigned* acc) {
    if (threadIdx.x == 0 && blockIdx.x == 0) { acc[0] += p[1]; acc[1] += 1; }
}
extern "C" __global__ void slow_fill(float* y, int n, long long cycles, float v) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = v;
}
"#;

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    scale_add: CudaFunction,
    shift: CudaFunction,
    accumulate: CudaFunction,
    slow_fill: CudaFunction,
}

fn gpu() -> Gpu {
    let n = CudaContext::device_count().expect("CUDA driver");
    assert!(n >= 1, "no CUDA GPU visible");
    let ctx = CudaContext::new(0).expect("context");
    // Captured buffers must not use cudarc's cross-stream event tracking.
    // SAFETY: every test orders its work on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("stream");
    let ptx = ferrum_graph::cudarc::nvrtc::compile_ptx(SRC).expect("NVRTC compile");
    let module = ctx.load_module(ptx).expect("module");
    Gpu {
        scale_add: module.load_function("scale_add").unwrap(),
        shift: module.load_function("shift").unwrap(),
        accumulate: module.load_function("accumulate").unwrap(),
        slow_fill: module.load_function("slow_fill").unwrap(),
        ctx,
        stream,
    }
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The two-kernel step: y = x * token + i; y = y * 0.5 + position - kv_len.
fn step(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    x: &CudaSlice<f32>,
    p: &StepParams,
    y: &mut CudaSlice<f32>,
) -> Result<(), DriverError> {
    let n = x.len() as i32;
    let mut b = stream.launch_builder(&g.scale_add);
    b.arg(x).arg(p.buffer()).arg(&mut *y).arg(&n);
    unsafe { b.launch(cfg(x.len())) }?;
    let mut b = stream.launch_builder(&g.shift);
    b.arg(&mut *y).arg(p.buffer()).arg(&n);
    unsafe { b.launch(cfg(x.len())) }?;
    Ok(())
}

fn not_capturing(stream: &Arc<CudaStream>) {
    assert_eq!(stream.capture_status().unwrap(), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_matches_eager_launches_for_every_step() {
    let g = gpu();
    let s = g.stream.clone();
    let n = 10_000;
    let host_x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5).collect();
    let x = s.clone_htod(&host_x).unwrap();
    let mut y_graph = s.alloc_zeros::<f32>(n).unwrap();
    let mut y_eager = s.alloc_zeros::<f32>(n).unwrap();
    let mut p = StepParams::new(&s).unwrap();

    let t = Instant::now();
    let graph = CapturedGraph::capture(&s, |scope| step(&g, scope.stream(), &x, &p, &mut y_graph)).unwrap();
    let capture_time = t.elapsed();
    graph.upload(&s).unwrap();
    assert_eq!(graph.kernel_count(), 2);
    println!("captured {graph:?} in {capture_time:?}");

    let steps = [(1u32, 0u32), (17, 1), (151_935, 2), (3, 4095), (0, 131_071), (65_535, 7)];
    for &(token, position) in &steps {
        let v = StepValues::decode(token, position);
        p.write(&s, v).unwrap();
        graph.replay(&s).unwrap();
        let got = s.clone_dtoh(&y_graph).unwrap();
        assert_eq!(p.read(&s).unwrap(), v);
        step(&g, &s, &x, &p, &mut y_eager).unwrap();
        let want = s.clone_dtoh(&y_eager).unwrap();
        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "token {token} position {position}: graph replay differs from eager launches");
        // And the kernels really ran with these values (host reference, FMA-tolerant).
        for i in [0, 1, n / 2, n - 1] {
            let r = (host_x[i] * token as f32 + i as f32) * 0.5 + position as f32 - (position + 1) as f32;
            assert!((got[i] - r).abs() <= 1e-3 * r.abs().max(1.0), "element {i}: {} vs {r}", got[i]);
        }
    }
    println!("{} steps: graph replay bit-identical to eager launches", steps.len());
    // The same graph also replays on another stream of the device.
    let other = g.ctx.new_stream().unwrap();
    s.synchronize().unwrap();
    graph.replay(&other).unwrap();
    other.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_many_times_reads_fresh_params_each_time() {
    let g = gpu();
    let s = g.stream.clone();
    let mut p = StepParams::new(&s).unwrap();
    let mut acc = s.alloc_zeros::<u32>(2).unwrap();
    let graph = CapturedGraph::capture(&s, |scope| {
        let mut b = scope.stream().launch_builder(&g.accumulate);
        b.arg(p.buffer()).arg(&mut acc);
        unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }?;
        Ok::<_, DriverError>(())
    })
    .unwrap();
    graph.upload(&s).unwrap();
    let reps = 10_000u32;
    let t = Instant::now();
    for pos in 0..reps {
        p.write(&s, StepValues::decode(1, pos)).unwrap();
        graph.replay(&s).unwrap();
    }
    let host_enqueue = t.elapsed();
    s.synchronize().unwrap();
    let total = t.elapsed();
    let got = s.clone_dtoh(&acc).unwrap();
    assert_eq!(got, vec![reps * (reps - 1) / 2, reps], "sum of positions / replay count");
    // Replay alone (no parameter write), host side.
    let t = Instant::now();
    for _ in 0..reps {
        graph.replay(&s).unwrap();
    }
    let replay_only = t.elapsed();
    s.synchronize().unwrap();
    println!(
        "{reps} x (write params + replay): host enqueue {:.2} us/step, with GPU {:.2} us/step; replay alone {:.2} us/replay (host)",
        host_enqueue.as_secs_f64() * 1e6 / f64::from(reps),
        total.as_secs_f64() * 1e6 / f64::from(reps),
        replay_only.as_secs_f64() * 1e6 / f64::from(reps),
    );
}

/// A normal capture + replay + eager launch after a failed capture: the stream still works.
fn stream_still_works(g: &Gpu) {
    let s = &g.stream;
    not_capturing(s);
    let x = s.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
    let mut y = s.alloc_zeros::<f32>(3).unwrap();
    let mut p = StepParams::new(s).unwrap();
    p.write(s, StepValues { token: 2, position: 10, kv_len: 4, user: 0 }).unwrap();
    let graph = CapturedGraph::capture(s, |scope| step(g, scope.stream(), &x, &p, &mut y)).unwrap();
    graph.replay(s).unwrap();
    // (x * 2 + i) * 0.5 + 10 - 4
    assert_eq!(s.clone_dtoh(&y).unwrap(), vec![7.0, 8.5, 10.0]);
    step(g, s, &x, &p, &mut y).unwrap();
    s.synchronize().unwrap();
}

fn expect_refused(name: &str, r: Result<CapturedGraph, GraphError>, g: &Gpu) {
    match r {
        Ok(graph) => panic!("{name}: capture succeeded ({graph:?}) but must be refused"),
        Err(e) => {
            println!("{name}: {e}");
            assert!(
                matches!(e, GraphError::CaptureInvalidated { .. } | GraphError::Forbidden { .. }),
                "{name}: unexpected error kind: {e:?}"
            );
        }
    }
    stream_still_works(g);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forbidden_operations_fail_clearly_and_leave_the_stream_usable() {
    let g = gpu();
    let s = g.stream.clone();
    let x = s.clone_htod(&[1.0f32; 256]).unwrap();
    let mut y = s.alloc_zeros::<f32>(256).unwrap();
    let p = StepParams::new(&s).unwrap();
    let mut dev = s.alloc_zeros::<u32>(4).unwrap();
    s.synchronize().unwrap();

    // A synchronous host-to-device copy (cuMemcpyHtoD) in the middle of a step.
    let dptr = {
        let (d, _r) = dev.device_ptr(&s);
        d
    };
    let r = CapturedGraph::capture(&s, |scope| {
        step(&g, scope.stream(), &x, &p, &mut y)?;
        unsafe { ferrum_graph::cudarc::driver::result::memcpy_htod_sync(dptr, &[1u32, 2, 3, 4]) }?;
        Ok::<_, DriverError>(())
    });
    // Seen on an H200 (driver 580): CUDA does not refuse this call. The copy goes to the legacy
    // stream, which does not synchronise with ferrum's non-blocking streams, so it runs
    // eagerly, outside the capture: the graph holds only the step's kernels, and replaying it
    // never touches host memory. Check exactly that.
    match r {
        Ok(graph) => {
            println!("synchronous cuMemcpyHtoD: ran eagerly, not captured ({graph:?})");
            assert_eq!(graph.node_count(), graph.kernel_count(), "no copy node may enter the graph");
        }
        Err(e) => {
            println!("synchronous cuMemcpyHtoD: {e}");
            assert!(matches!(e, GraphError::CaptureInvalidated { .. } | GraphError::Forbidden { .. }), "{e:?}");
        }
    }
    stream_still_works(&g);

    // A stream synchronisation.
    let r = CapturedGraph::capture(&s, |scope| {
        step(&g, scope.stream(), &x, &p, &mut y)?;
        scope.stream().synchronize()
    });
    expect_refused("stream synchronize", r, &g);

    // A device-to-host read (cudarc's clone_dtoh).
    let r = CapturedGraph::capture(&s, |scope| {
        step(&g, scope.stream(), &x, &p, &mut y)?;
        let _host = scope.stream().clone_dtoh(&y)?;
        Ok::<_, DriverError>(())
    });
    expect_refused("clone_dtoh", r, &g);

    // An asynchronous host-to-device copy (cudarc's memcpy_htod from a host array).
    let r = CapturedGraph::capture(&s, |scope| {
        scope.stream().memcpy_htod(&[5u32, 6, 7, 8], &mut dev)?;
        step(&g, scope.stream(), &x, &p, &mut y)
    });
    expect_refused("async memcpy_htod", r, &g);

    // The closure swallows the error of a forbidden call: still refused.
    let r = CapturedGraph::capture(&s, |scope| {
        step(&g, scope.stream(), &x, &p, &mut y)?;
        let _ = scope.stream().synchronize();
        Ok::<_, DriverError>(())
    });
    expect_refused("swallowed synchronize error", r, &g);

    // Writing step parameters inside capture is refused by StepParams itself.
    let mut p2 = StepParams::new(&s).unwrap();
    let r = CapturedGraph::capture(&s, |_scope| p2.write(&s, StepValues::decode(1, 1)));
    // Either form is a refusal that names the rule (seen on an H200: the capture reports it as
    // invalidated, with StepParams' own message as the cause).
    match r {
        Err(GraphError::Closure(e)) => println!("StepParams::write inside capture: {e}"),
        Err(GraphError::CaptureInvalidated { cause }) if cause.contains("outside capture") => {
            println!("StepParams::write inside capture: {cause}")
        }
        other => panic!("StepParams::write inside capture: {other:?}"),
    }
    stream_still_works(&g);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_preconditions_and_panics() {
    let g = gpu();
    // The legacy default stream cannot be captured.
    let legacy = g.ctx.default_stream();
    assert!(matches!(CapturedGraph::capture(&legacy, |_| Ok::<_, DriverError>(())), Err(GraphError::LegacyStream)));
    // A context that tracks events across streams is refused.
    let tracked = CudaContext::new(0).unwrap();
    let s1 = tracked.new_stream().unwrap();
    let _s2 = tracked.new_stream().unwrap();
    let r = CapturedGraph::capture(&s1, |_| Ok::<_, DriverError>(()));
    assert!(matches!(r, Err(GraphError::EventTracking)), "{r:?}");
    // A closure error (capture still valid) is returned as such.
    let r = CapturedGraph::capture(&g.stream, |_| Err::<(), _>("model not loaded"));
    match r {
        Err(GraphError::Closure(e)) => assert_eq!(e.to_string(), "model not loaded"),
        other => panic!("{other:?}"),
    }
    stream_still_works(&g);
    // A panicking closure ends the capture during unwinding.
    let s = g.stream.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        CapturedGraph::capture(&s, |_| -> Result<(), DriverError> { panic!("closure panics") })
    }));
    assert!(r.is_err());
    stream_still_works(&g);
    // An empty capture is a valid (empty) graph.
    let empty = CapturedGraph::capture(&g.stream, |_| Ok::<_, DriverError>(())).unwrap();
    assert_eq!(empty.node_count(), 0);
    empty.replay(&g.stream).unwrap();
    g.stream.synchronize().unwrap();
    println!("preconditions and panic recovery: ok");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_cache_recaptures_only_when_buffers_change() {
    let g = gpu();
    let s = g.stream.clone();
    let x = s.clone_htod(&(0..512).map(|i| i as f32).collect::<Vec<_>>()).unwrap();
    let mut ya = s.alloc_zeros::<f32>(512).unwrap();
    let mut yb = s.alloc_zeros::<f32>(512).unwrap();
    let mut p = StepParams::new(&s).unwrap();
    let key = |y: &CudaSlice<f32>| {
        let (d, _r) = y.device_ptr(&s);
        (vec![d, p.device_ptr()], "f32")
    };
    let (ka, kb) = (key(&ya), key(&yb));
    let mut cache: DecodeGraphCache<(Vec<u64>, &str)> = DecodeGraphCache::new(8);
    let mut captures = 0;
    for pos in 0..20u32 {
        p.write(&s, StepValues::decode(3, pos)).unwrap();
        let (k, y) = if pos < 10 { (ka.clone(), &mut ya) } else { (kb.clone(), &mut yb) };
        if cache.replay_or_capture(k, &s, |scope| step(&g, scope.stream(), &x, &p, y)).unwrap() {
            captures += 1;
        }
        let got = s.clone_dtoh(if pos < 10 { &ya } else { &yb }).unwrap();
        // (i * 3 + i) * 0.5 + pos - (pos + 1) = 2i - 1
        assert_eq!(got[100], 199.0, "pos {pos}");
    }
    assert_eq!(captures, 2);
    let stats = cache.stats();
    assert_eq!((stats.captures, stats.hits), (2, 18));
    assert!(cache.invalidate(&ka).is_some());
    println!("graph cache over 20 steps and 2 buffer sets: {stats:?}");
}

/// A held buffer outlives a replay on another stream than its own: dropping the graph waits for
/// the replay before the buffer is freed (it used to be freed at once, by a `cuMemFreeAsync` on
/// the buffer's stream, which is not ordered after the other stream's replay).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_a_graph_waits_for_its_replays_before_releasing_held_buffers() {
    let g = gpu();
    let s = g.stream.clone();
    let other = g.ctx.new_stream().unwrap();
    let n = 4096usize; // one wave of blocks: the kernel takes `cycles` once
    let cycles: i64 = 300_000_000; // ~0.15 s at 2 GHz
    let mut y = s.alloc_zeros::<f32>(n).unwrap();
    let y_ptr = y.device_ptr(&s).0;
    let mut graph = CapturedGraph::capture(&s, |scope| {
        let mut b = scope.stream().launch_builder(&g.slow_fill);
        let (n32, v) = (n as i32, 7.0f32);
        b.arg(&mut y).arg(&n32).arg(&cycles).arg(&v);
        unsafe { b.launch(cfg(n)) }?;
        Ok::<_, DriverError>(())
    })
    .unwrap();
    // How long one replay takes.
    graph.replay(&other).unwrap();
    let t = Instant::now();
    other.synchronize().unwrap();
    let replay_time = t.elapsed();
    assert!(replay_time.as_millis() >= 20, "the slow kernel took only {replay_time:?}");

    graph.hold(y);
    s.synchronize().unwrap();
    graph.replay(&other).unwrap();
    let t = Instant::now();
    drop(graph);
    let drop_time = t.elapsed();
    // Memory freed on `s` may be handed out again at once, ordered only after the free.
    let z = s.alloc_zeros::<f32>(n).unwrap();
    let reused = z.device_ptr(&s).0 == y_ptr;
    let t = Instant::now();
    other.synchronize().unwrap();
    let still_running = t.elapsed();
    let got = s.clone_dtoh(&z).unwrap();
    println!(
        "replay {replay_time:?}; drop waited {drop_time:?}; replay still running after drop: {still_running:?}; \
         freed buffer reused: {reused}"
    );
    assert!(drop_time >= replay_time / 2, "drop returned after {drop_time:?}, before the replay ended");
    assert!(got.iter().all(|&x| x == 0.0), "the replay wrote into the held buffer after it was freed");
}
