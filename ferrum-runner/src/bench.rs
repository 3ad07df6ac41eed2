//! `ferrum bench`: prefill time and decode speed, median of several runs, as a table or JSON.
//!
//! Each run prefills a prompt of `--prompt-tokens` token ids and then decodes `--gen-tokens`
//! steps greedily. On CUDA the tokens are chosen on the GPU and every step is one graph replay
//! (the default, as in `ferrum generate`): a run's time per token is its decode time over its
//! steps, and the median (and worst) over the runs after the warm-up run is reported. With
//! `--host-loop` (and on the CPU) every step is timed alone and the median (and p99) over all
//! steps is reported.
use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use ferrum_runner::backend::{DecodeBackend, DeviceRun, DeviceSampling};
use ferrum_runner::config::ModelConfig;
use ferrum_runner::load::load_model;
use ferrum_runner::sampling::argmax;
use ferrum_runner::session::{cpu_backend, weight_bytes_per_token, DeviceSpec};
use ferrum_runner::weights::WeightFormat;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Benchmark a random-weight model of a known shape instead of a file:
    /// smollm2-135m, llama3.2-1b, llama3-8b, qwen2.5-7b.
    #[arg(long, value_name = "NAME", conflicts_with = "model")]
    synthetic: Option<String>,
    /// Prompt length for the prefill.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Decode steps per run.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Timed runs (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Instead of a model: the latency of one decode-sized all-reduce over --tp GPUs (NCCL and
    /// the one-shot peer kernel), inside a CUDA graph and eager (needs --device cuda, --tp 2+).
    #[arg(long, conflicts_with_all = ["synthetic", "model"])]
    all_reduce: bool,
    /// Elements per all-reduce for --all-reduce (a decode step reduces `hidden` of them).
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// After the timed runs, time every kernel of one decode step (at the middle of the
    /// generation) and print where the step's time goes (one GPU only; the events serialise
    /// the kernels, so the total exceeds a normal step).
    #[arg(long)]
    kernel_profile: bool,
    /// After the timed runs, record the kernel timeline of this many graph replays (one more
    /// generation) and print what each kernel of the step cost inside the graph: the time from
    /// its earliest wait release to the next kernel's. Needs the timeline build of the kernels
    /// (`cargo xtask ptx --timeline`, a measurement build) and the device loop with graphs.
    #[arg(long, value_name = "STEPS", value_parser = clap::value_parser!(u64).range(1..=100_000), conflicts_with = "all_reduce")]
    timeline: Option<u64>,
    /// Wrap the last run's decode in `cuProfilerStart` / `cuProfilerStop` on every GPU of the
    /// group, so that `ncu --profile-from-start off` profiles only its kernels (the steps as
    /// replayed from the captured graphs). Changes nothing without a profiler attached.
    #[arg(long)]
    profiler_range: bool,
}

/// One kernel's share of a profiled decode step.
#[derive(Serialize, Debug)]
struct KernelRow {
    kernel: &'static str,
    launches: usize,
    total_us: f64,
    share: f64,
}

/// Sums a step profile per kernel name, largest first.
fn kernel_rows(p: &[(&'static str, f64)]) -> Vec<KernelRow> {
    let total: f64 = p.iter().map(|x| x.1).sum();
    let mut rows: Vec<KernelRow> = Vec::new();
    for &(k, us) in p {
        match rows.iter_mut().find(|r| r.kernel == k) {
            Some(r) => {
                r.launches += 1;
                r.total_us += us;
            }
            None => rows.push(KernelRow { kernel: k, launches: 1, total_us: us, share: 0.0 }),
        }
    }
    for r in &mut rows {
        r.share = if total > 0.0 { r.total_us / total } else { 0.0 };
    }
    rows.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
    rows
}

#[derive(Serialize, Debug)]
struct Report {
    model: String,
    backend: String,
    prompt_tokens: usize,
    gen_tokens: usize,
    runs: usize,
    prefill_ms_median: f64,
    decode_ms_per_token_median: f64,
    /// Host loop: the 99th percentile over all timed steps; device loop: the slowest run's
    /// mean (a run is timed as a whole).
    decode_ms_per_token_p99: f64,
    decode_tok_per_s: f64,
    weight_bytes_per_token: u64,
    achieved_gb_per_s: f64,
    /// GPU only: a large device-to-device copy, bytes read + written per second.
    copy_gb_per_s: Option<f64>,
    /// GPU only: achieved weight bandwidth over the copy bandwidth.
    share_of_copy_bandwidth: Option<f64>,
    threads: usize,
    /// `device loop (graphs)`, `device loop (eager)` or `host loop`.
    mode: String,
    /// `screened` (the device loop's greedy steps read the LM head's int8 copy and re-read
    /// only the rows that may win: `weight_bytes_per_token` and the shares above still count
    /// the whole head) or `full`.
    lm_head: &'static str,
    /// Device loop with graphs: host time spent queueing replays per token (mean over the timed
    /// runs; one replay a token unless `FERRUM_GRAPH_STEPS` packs several steps a graph), µs.
    host_us_per_token: Option<f64>,
    /// Device loop with graphs: time to capture, instantiate and upload the step graph, ms
    /// (of the last run that captured; on TP, rank 0's). None when every graph the runs
    /// replayed was captured before them (by the step tuning's probe in `prepare`, say).
    capture_ms: Option<f64>,
    /// `--kernel-profile`: GPU time per kernel of one profiled decode step, largest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_profile: Option<Vec<KernelRow>>,
    /// `--kernel-profile`: the same for one prefill of the prompt (cuBLAS GEMMs as
    /// `cublas_gemm`).
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_kernel_profile: Option<Vec<KernelRow>>,
    /// `--timeline`: per rank, what each kernel cost inside the replayed graph.
    #[serde(skip_serializing_if = "Option::is_none")]
    timeline: Option<Vec<TimelineReport>>,
}

/// One rank's `--timeline` figures.
#[derive(Debug, Serialize)]
struct TimelineReport {
    replays: usize,
    /// Mean time from a replay's first kernel release to its last one's, µs.
    span_us: Option<f64>,
    /// Replays whose stamps could not be mapped onto the graph's kernels (left out).
    unmapped: usize,
    /// The first unmapped replay's `(stamps, kernel nodes)`.
    first_unmapped: Option<(usize, usize)>,
    /// Kernel releases that run backwards in a mapped replay (nonzero: do not trust the figures).
    out_of_order: usize,
    /// Grid ids of the first mapped replay's first kernels.
    first_grids: Vec<u64>,
    /// The repeating layer over the middle layers, from the attention on: each kernel's mean
    /// cost (µs) and the mean time of each phase its body stamps (µs after its earliest
    /// release; `None` where it stamps none).
    layer: Option<Vec<LayerRow>>,
    /// Every kernel node of the step in graph order: name, mean µs, spread of its blocks'
    /// wait releases in µs, their earliest and latest arrival at the wait in µs after the
    /// earliest release, blocks that stamped (the first 8 and every 32nd).
    kernels: Vec<TimelineKernel>,
}

/// One kernel of the middle layer: name, mean µs, each phase's mean µs after its release.
type LayerRow = (String, f64, Vec<Option<f64>>);

#[derive(Debug, Serialize)]
struct TimelineKernel {
    name: String,
    mean_us: Option<f64>,
    spread_us: f64,
    /// The stamped blocks' earliest and latest arrival at the wait, µs after the earliest
    /// release (negative: before it).
    arrive_us: (f64, f64),
    /// The mean time of each phase its body stamps, µs after the earliest release.
    phases_us: Vec<Option<f64>>,
    stamped_blocks: u32,
}

fn timeline_report(t: &ferrum_cuda::timeline::StepTimeline) -> TimelineReport {
    TimelineReport {
        replays: t.replays,
        span_us: t.span_ns().map(|n| n / 1e3),
        unmapped: t.unmapped,
        first_unmapped: t.first_unmapped,
        out_of_order: t.out_of_order,
        first_grids: t.first_grids.clone(),
        layer: ferrum_cuda::timeline::layer_phases(t).map(|l| {
            l.into_iter().map(|(n, v, ph)| (n, v / 1e3, ph.iter().map(|p| p.map(|p| p / 1e3)).collect())).collect()
        }),
        kernels: t
            .kernels
            .iter()
            .map(|k| TimelineKernel {
                name: k.name.clone(),
                mean_us: k.mean_ns().map(|n| n / 1e3),
                spread_us: k.spread_ns() / 1e3,
                arrive_us: (k.arrivals_ns().0 / 1e3, k.arrivals_ns().1 / 1e3),
                phases_us: k.phases_ns().iter().map(|p| p.map(|p| p / 1e3)).collect(),
                stamped_blocks: k.blocks,
            })
            .collect(),
    }
}

/// `--profiler-range`: starts or stops the profiler's collection on every GPU of this process:
/// the group's in a one-process run, the rank's own in a multi-process one (the GPU that
/// `cuda_tp` gives the rank: `(ordinal + rank) % device count`).
fn profiler_range(opts: &ferrum_runner::session::SessionOptions, on: bool) -> Result<()> {
    let DeviceSpec::Cuda(first) = opts.device else { bail!("--profiler-range needs --device cuda") };
    let gpus: Vec<usize> = match &opts.dist {
        Some(d) => vec![(first + d.rank) % ferrum_cuda::device_count()?.max(1)],
        None => (first..first + opts.tp.max(1)).collect(),
    };
    for ordinal in gpus {
        ferrum_cuda::profiler_range(ordinal, on)?;
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A kernel's stamped phases as the timeline lines print them (`"  phases 0:1.10 3:2.72"`: phase
/// k at µs after the kernel's earliest release), or nothing when it stamps none.
fn phases_text(phases: &[Option<f64>]) -> String {
    let ph: Vec<String> = phases.iter().enumerate().filter_map(|(k, p)| p.map(|p| format!("{k}:{p:.2}"))).collect();
    if ph.is_empty() {
        String::new()
    } else {
        format!("  phases {}", ph.join(" "))
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_tokens == 0 || a.gen_tokens == 0 || a.runs == 0 {
        bail!("--prompt-tokens, --gen-tokens and --runs must be at least 1");
    }
    let opts = a.model.to_options()?;
    // Only a model on CUDA runs as one rank of a multi-process group: refuse the flags where
    // they would be ignored (a synthetic model on CUDA refuses them when it opens).
    if opts.dist.is_some() {
        if a.all_reduce {
            bail!("--all-reduce runs one thread per GPU in one process: drop --rank/--world-size/--rendezvous");
        }
        if opts.device == DeviceSpec::Cpu {
            bail!("--rank/--world-size run one process per GPU: use --device cuda");
        }
    }
    if a.all_reduce {
        if a.profiler_range {
            bail!("--profiler-range brackets a model's decode, not --all-reduce");
        }
        return all_reduce(&a, &opts);
    }
    // Checked before any model loads (`--prompt-tokens 18446744073709551615` overflows).
    let capacity = a
        .prompt_tokens
        .checked_add(a.gen_tokens)
        .context("--prompt-tokens + --gen-tokens overflow: give counts within the model's context")?;
    let (mut backend, cfg, bytes, name): (Box<dyn DecodeBackend>, ModelConfig, u64, String) =
        match (&a.synthetic, opts.device) {
            (Some(name), DeviceSpec::Cpu) => {
                let cfg = ferrum_runner::synthetic::named_config(name)
                    .with_context(|| format!("--synthetic `{name}`: unknown shape"))?;
                let dtype = opts.dtype.unwrap_or(candle_core::DType::F32);
                eprintln!("building random {name} weights on the CPU ({dtype:?})…");
                let w = ferrum_runner::synthetic::random_weights(&cfg, dtype, 0)?;
                let b = cpu_backend(&w, WeightFormat::Dense(dtype), opts.tp, true)?;
                (b, cfg, weight_bytes_per_token(&w), format!("synthetic:{name}"))
            }
            (Some(name), DeviceSpec::Cuda(ordinal)) => synthetic_cuda(name, ordinal, &opts)?,
            (None, DeviceSpec::Cpu) => {
                let path = match &opts.model {
                    Some(p) => p.clone(),
                    None => ferrum_runner::fetch::default_model_path(true)?,
                };
                let format = opts.dtype.map_or(WeightFormat::Quantized, WeightFormat::Dense);
                let m = load_model(&path, format)?;
                let b = cpu_backend(&m.weights, format, opts.tp, true)?;
                (b, m.weights.config.clone(), weight_bytes_per_token(&m.weights), path.display().to_string())
            }
            (None, DeviceSpec::Cuda(ordinal)) => file_cuda(ordinal, &opts)?,
        };
    // Before the backend's set-up (the step tuning on CUDA): a bad request fails fast.
    if capacity > cfg.max_position_embeddings {
        bail!(
            "--prompt-tokens + --gen-tokens ({} + {}) exceed the model's context of {}",
            a.prompt_tokens,
            a.gen_tokens,
            cfg.max_position_embeddings
        );
    }
    // The bench decodes greedily: the screened LM head unless --full-head (the same tokens).
    let screened = !a.model.full_head
        && backend.set_screened_head(true).unwrap_or_else(|e| {
            eprintln!("no screened LM head ({e}); timing the whole head");
            false
        });
    backend.prepare()?;
    // A fixed pseudo-random prompt (not all zeros: real ids exercise real embedding rows).
    let prompt: Vec<u32> =
        (0..a.prompt_tokens).map(|i| ((i as u64 * 2_654_435_761 + 12345) % cfg.vocab_size as u64) as u32).collect();
    let mut prefill_ms = Vec::new();
    let mut step_ms = Vec::new();
    let device = backend.has_device_decode() && !a.model.host_loop;
    if a.profiler_range && !device {
        bail!("--profiler-range needs the device loop (--device cuda, without --host-loop)");
    }
    if a.timeline.is_some() && !device {
        bail!("--timeline needs the device loop (--device cuda, without --host-loop)");
    }
    // Host time queueing replays, the replays and the steps they ran (a replay may run several).
    let (mut enqueue_s, mut replays, mut graphed_steps, mut capture_ms) = (0.0f64, 0u64, 0u64, None);
    for run in 0..=a.runs {
        let t = Instant::now();
        let mut logits = backend.prefill(&prompt, capacity)?;
        let pf = t.elapsed().as_secs_f64() * 1e3;
        let mut steps = Vec::with_capacity(a.gen_tokens);
        if device {
            let ranged = a.profiler_range && run == a.runs;
            if ranged {
                profiler_range(&opts, true)?;
            }
            let t = Instant::now();
            let d: DeviceRun =
                backend.decode_on_device(argmax(&logits), a.gen_tokens, DeviceSampling::Greedy, &mut |_| Ok(true))?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if ranged {
                profiler_range(&opts, false)?;
            }
            if d.kept != a.gen_tokens {
                bail!("the device loop ran {} of {} steps", d.kept, a.gen_tokens);
            }
            if d.captures > 0 {
                capture_ms = Some(d.capture_time.as_secs_f64() * 1e3);
            }
            // One entry per run: its mean time per token (the capture, if any, excluded).
            steps.push((ms - d.capture_time.as_secs_f64() * 1e3) / a.gen_tokens as f64);
            if run > 0 {
                enqueue_s += d.enqueue_time.as_secs_f64();
                replays += d.replays;
                if d.replays > 0 {
                    graphed_steps += d.run as u64;
                }
            }
        } else {
            for _ in 0..a.gen_tokens {
                let tok = argmax(&logits);
                let t = Instant::now();
                logits = backend.step(tok)?;
                steps.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        if run > 0 {
            prefill_ms.push(pf);
            step_ms.extend(steps);
        }
    }
    let prefill_kernel_profile =
        if a.kernel_profile { backend.profile_prefill(&prompt, capacity)?.map(|p| kernel_rows(&p)) } else { None };
    let kernel_profile = if a.kernel_profile {
        let logits = backend.prefill(&prompt, capacity)?;
        let mut tok = argmax(&logits);
        for _ in 0..a.gen_tokens / 2 {
            tok = argmax(&backend.step(tok)?);
        }
        let p = backend
            .profile_step(tok)?
            .with_context(|| format!("--kernel-profile: nothing to profile on {}", backend.describe()))?;
        Some(kernel_rows(&p))
    } else {
        None
    };
    let timeline = match a.timeline {
        None => None,
        Some(steps) => {
            let steps = (steps as usize).min(a.gen_tokens);
            let logits = backend.prefill(&prompt, capacity)?;
            if !backend.arm_timeline(steps)? {
                bail!(
                    "--timeline needs the timeline build of the kernels (`cargo xtask ptx --timeline`, then \
                     rebuild) and graph replays"
                );
            }
            backend.decode_on_device(argmax(&logits), a.gen_tokens, DeviceSampling::Greedy, &mut |_| Ok(true))?;
            Some(backend.take_timelines()?.iter().map(timeline_report).collect::<Vec<_>>())
        }
    };
    prefill_ms.sort_by(f64::total_cmp);
    step_ms.sort_by(f64::total_cmp);
    let med = percentile(&step_ms, 0.5);
    let achieved = bytes as f64 / (med * 1e-3) / 1e9;
    let copy_gb_per_s = match opts.device {
        DeviceSpec::Cuda(ordinal) => {
            Some(ferrum_cuda::measure_copy_bandwidth(ordinal, 2 << 30)?.bytes_per_second / 1e9)
        }
        DeviceSpec::Cpu => None,
    };
    let r = Report {
        model: name,
        backend: backend.describe(),
        prompt_tokens: a.prompt_tokens,
        gen_tokens: a.gen_tokens,
        runs: a.runs,
        prefill_ms_median: percentile(&prefill_ms, 0.5),
        decode_ms_per_token_median: med,
        decode_ms_per_token_p99: percentile(&step_ms, 0.99),
        decode_tok_per_s: 1e3 / med,
        weight_bytes_per_token: bytes,
        achieved_gb_per_s: achieved,
        copy_gb_per_s,
        share_of_copy_bandwidth: copy_gb_per_s.map(|c| achieved / c),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        mode: match (device, replays > 0) {
            (true, true) => "device loop (graphs)",
            (true, false) => "device loop (eager)",
            (false, _) => "host loop",
        }
        .to_string(),
        lm_head: if screened && device { "screened" } else { "full" },
        host_us_per_token: (graphed_steps > 0).then(|| enqueue_s / graphed_steps as f64 * 1e6),
        capture_ms,
        kernel_profile,
        prefill_kernel_profile,
        timeline,
    };
    // The whole report in one write: a closed stdout (`| head`) is no error (see `print_out`).
    let mut o = String::new();
    if a.json {
        writeln!(o, "{}", serde_json::to_string_pretty(&r)?)?;
    } else {
        writeln!(o, "model                 {}", r.model)?;
        writeln!(o, "backend               {}  ({} cores)", r.backend, r.threads)?;
        writeln!(o, "prompt / gen tokens   {} / {} × {} runs", r.prompt_tokens, r.gen_tokens, r.runs)?;
        writeln!(o, "prefill               {:.2} ms (median)", r.prefill_ms_median)?;
        writeln!(o, "mode                  {}, LM head {}", r.mode, r.lm_head)?;
        let worst = if device { "worst run" } else { "p99" };
        writeln!(o, "decode                {:.3} ms/token median, {:.3} {worst}", med, r.decode_ms_per_token_p99)?;
        match (r.host_us_per_token, r.capture_ms) {
            (Some(h), Some(c)) => writeln!(o, "host per token        {h:.2} µs to queue a replay; capture {c:.1} ms")?,
            (Some(h), None) => {
                writeln!(o, "host per token        {h:.2} µs to queue a replay (graphs captured before the runs)")?
            }
            _ => {}
        }
        writeln!(o, "decode speed          {:.1} tok/s", r.decode_tok_per_s)?;
        writeln!(o, "weights read / token  {:.1} MB → {:.1} GB/s", bytes as f64 / 1e6, r.achieved_gb_per_s)?;
        if let (Some(c), Some(f)) = (r.copy_gb_per_s, r.share_of_copy_bandwidth) {
            writeln!(
                o,
                "copy bandwidth        {c:.0} GB/s (device-to-device, read + write) → {:.1}% of it",
                f * 100.0
            )?;
        }
        for (rank, t) in r.timeline.iter().flatten().enumerate() {
            let span = t.span_us.map_or("?".into(), |s| format!("{s:.2}"));
            writeln!(
                o,
                "timeline              rank {rank}: {} replays ({} unmapped), {span} µs from the first kernel's \
                 release to the last's, {} out of order; first grid ids {:?}",
                t.replays, t.unmapped, t.out_of_order, t.first_grids
            )?;
            if let (0, Some((stamps, nodes))) = (t.replays, t.first_unmapped) {
                writeln!(
                    o,
                    "  no replay mapped: the first had {stamps} stamps for {nodes} kernel nodes (each node must \
                     stamp once: ferrum_cuda::timeline::stamps says which do)"
                )?;
            }
            if let Some(layer) = &t.layer {
                let total: f64 = layer.iter().map(|(_, v, _)| v).sum();
                writeln!(
                    o,
                    "  one middle layer, {total:.2} µs (mean over the middle layers; then the phases its body \
                     stamps, µs after its earliest release: gemv.cu and attention.cu list them):"
                )?;
                for (name, v, ph) in layer {
                    let ph = phases_text(ph);
                    writeln!(o, "    {name:<40} {v:>7.2} µs{ph}")?;
                }
            }
            writeln!(
                o,
                "  every kernel of the step (mean µs to the next kernel's release, spread of the stamped \
                 releases, stamped blocks: the first 8 and every 32nd; their earliest and latest arrival \
                 at the wait, µs after the earliest release; the phases its body stamps):"
            )?;
            for k in &t.kernels {
                let m = k.mean_us.map_or("?".into(), |m| format!("{m:.2}"));
                let ph = phases_text(&k.phases_us);
                writeln!(
                    o,
                    "    {:<40} {m:>7} {:>7.2} {:>6} {:>7.2} {:>7.2}{ph}",
                    k.name, k.spread_us, k.stamped_blocks, k.arrive_us.0, k.arrive_us.1
                )?;
            }
        }
        for (what, rows) in [("one decode step", &r.kernel_profile), ("one prefill", &r.prefill_kernel_profile)] {
            let Some(rows) = rows else { continue };
            let total: f64 = rows.iter().map(|r| r.total_us).sum();
            writeln!(o, "kernel profile        {what}, {total:.1} µs with an event after every kernel:")?;
            for k in rows {
                writeln!(
                    o,
                    "  {:<34} {:>4} × {:>8.2} µs = {:>9.1} µs  {:>5.1}%",
                    k.kernel,
                    k.launches,
                    k.total_us / k.launches as f64,
                    k.total_us,
                    k.share * 100.0
                )?;
            }
        }
    }
    print_out(&o)
}

/// Writes `text` to stdout; a closed stdout (`| head`, `| true`) is no error: the reader
/// wanted no more.
pub(crate) fn print_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing the report to stdout"),
    }
}

#[cfg(feature = "cuda")]
fn all_reduce(a: &BenchArgs, opts: &ferrum_runner::session::SessionOptions) -> Result<()> {
    match opts.device {
        DeviceSpec::Cuda(first) => crate::bench_allreduce::run(first, opts.tp, a.hidden, a.json),
        DeviceSpec::Cpu => bail!("--all-reduce measures GPU all-reduces: use --device cuda"),
    }
}

#[cfg(not(feature = "cuda"))]
fn all_reduce(_: &BenchArgs, _: &ferrum_runner::session::SessionOptions) -> Result<()> {
    bail!("--all-reduce needs CUDA: this ferrum was built without CUDA support; rebuild with `--features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn synthetic_cuda(
    _: &str,
    _: usize,
    _: &ferrum_runner::session::SessionOptions,
) -> Result<(Box<dyn DecodeBackend>, ModelConfig, u64, String)> {
    bail!("--device cuda is not available: this ferrum was built without CUDA support; rebuild with `--features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn file_cuda(
    _: usize,
    _: &ferrum_runner::session::SessionOptions,
) -> Result<(Box<dyn DecodeBackend>, ModelConfig, u64, String)> {
    bail!("--device cuda is not available: this ferrum was built without CUDA support; rebuild with `--features cuda`")
}

#[cfg(feature = "cuda")]
fn synthetic_cuda(
    name: &str,
    ordinal: usize,
    opts: &ferrum_runner::session::SessionOptions,
) -> Result<(Box<dyn DecodeBackend>, ModelConfig, u64, String)> {
    let cfg =
        ferrum_runner::synthetic::named_config(name).with_context(|| format!("--synthetic `{name}`: unknown shape"))?;
    let (b, bytes) = ferrum_runner::cuda_backend::open_synthetic(&cfg, ordinal, opts)?;
    Ok((b, cfg, bytes, format!("synthetic:{name}")))
}

#[cfg(feature = "cuda")]
fn file_cuda(
    ordinal: usize,
    opts: &ferrum_runner::session::SessionOptions,
) -> Result<(Box<dyn DecodeBackend>, ModelConfig, u64, String)> {
    let path = match &opts.model {
        Some(p) => p.clone(),
        None => ferrum_runner::fetch::default_model_path(true)?,
    };
    let m = load_model(&path, WeightFormat::Dense(candle_core::DType::F32))?;
    let b = ferrum_runner::session::cuda_backend(&m, ordinal, opts, true)?;
    let bytes = ferrum_runner::cuda_backend::weight_bytes_per_token(&m.weights.config, opts);
    Ok((b, m.weights.config.clone(), bytes, path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_print_only_the_stamped_ones() {
        assert_eq!(phases_text(&[None, None]), "");
        assert_eq!(phases_text(&[Some(1.104), None, None, Some(2.7)]), "  phases 0:1.10 3:2.70");
    }

    #[test]
    fn kernel_rows_sum_per_kernel_largest_first() {
        let p = [("gemv", 3.0), ("attn", 1.0), ("gemv", 5.0), ("(end)", 1.0)];
        let rows = kernel_rows(&p);
        let got: Vec<_> = rows.iter().map(|r| (r.kernel, r.launches, r.total_us)).collect();
        assert_eq!(got, vec![("gemv", 2, 8.0), ("attn", 1, 1.0), ("(end)", 1, 1.0)]);
        assert!((rows[0].share - 0.8).abs() < 1e-12);
        assert!(kernel_rows(&[]).is_empty());
    }
}
