//! `cargo xtask ci [--gpu]`: everything CI checks, in order, printing each command before it
//! runs and a summary at the end. The test counts of every `cargo test` run are added up and
//! printed as a final `N passed, N failed` line.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct CiArgs {
    /// Also run the GPU tests (needs a CUDA GPU and the `cuda` feature build).
    #[arg(long)]
    pub gpu: bool,
    /// Skip `ptx --check` (for machines where the pinned nvcc cannot be installed).
    #[arg(long)]
    pub no_ptx: bool,
}

#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
    ignored: u64,
    steps: Vec<(String, f64, bool)>,
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

impl Tally {
    /// Runs `cmd`, streaming its output, and records whether it succeeded. Test-result lines
    /// are parsed so the totals can be printed at the end.
    fn run(&mut self, label: &str, mut cmd: Command) -> Result<()> {
        eprintln!("\n==> {label}\n    $ {cmd:?}");
        let t = Instant::now();
        cmd.stdout(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("starting {label}"))?;
        let out = child.stdout.take().context("no stdout")?;
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let num = |key: &str| -> u64 {
                    rest.split(';')
                        .find_map(|p| p.trim().strip_suffix(key).map(|n| n.trim().rsplit(' ').next().unwrap_or("0")))
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0)
                };
                self.passed += num(" passed");
                self.failed += num(" failed");
                self.ignored += num(" ignored");
            }
        }
        let ok = child.wait()?.success();
        self.steps.push((label.to_string(), t.elapsed().as_secs_f64(), ok));
        if !ok {
            self.summary();
            bail!("{label} failed");
        }
        Ok(())
    }

    fn summary(&self) {
        eprintln!("\n==> summary");
        for (label, secs, ok) in &self.steps {
            eprintln!("    {:<4} {secs:>7.1}s  {label}", if *ok { "ok" } else { "FAIL" });
        }
        // The plain closing line CI reads.
        println!("{} passed, {} failed, {} skipped", self.passed, self.failed, self.ignored);
    }
}

pub fn run(a: CiArgs) -> Result<()> {
    let mut t = Tally::default();
    let mut c = cargo();
    c.args(["fmt", "--all", "--", "--check"]);
    t.run("rustfmt", c)?;

    let mut c = cargo();
    c.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    t.run("clippy (default features)", c)?;
    let mut c = cargo();
    c.args(["clippy", "-p", "ferrum-runner", "--all-targets", "--features", "cuda", "--", "-D", "warnings"]);
    t.run("clippy (cuda feature: builds without a CUDA toolkit)", c)?;
    let mut c = cargo();
    c.args(["clippy", "-p", "ferrum-tp", "--all-targets", "--no-default-features", "--features", "barrier-std"]);
    c.args(["--", "-D", "warnings"]);
    t.run("clippy (ferrum-tp, barrier-std)", c)?;

    if !a.no_ptx {
        let mut c = cargo();
        c.args(["xtask", "ptx", "--check"]);
        t.run("ptx --check (PTX fresh, no spills, every kernel present)", c)?;
    }

    let mut c = cargo();
    c.args(["test", "--workspace"]);
    t.run("tests (workspace, barrier-spin-park)", c)?;
    let mut c = cargo();
    c.args(["test", "-p", "ferrum-tp", "--no-default-features", "--features", "barrier-std"]);
    t.run("tests (ferrum-tp, barrier-std)", c)?;
    let mut c = cargo();
    c.args(["test", "-p", "ferrum-runner", "--no-default-features", "--features", "barrier-std,cli", "--test", "tp"]);
    t.run("tests (CPU tensor parallelism, barrier-std)", c)?;
    // The `cuda` feature's unit tests need no GPU (the driver is loaded only when used): the
    // host-side parts of the CUDA backend (knobs, the peer kernels' parameter layout).
    let mut c = cargo();
    c.args(["test", "-p", "ferrum-cuda", "-p", "ferrum-runner", "--features", "cuda", "--lib"]);
    t.run("unit tests (cuda feature, no GPU needed)", c)?;

    // Loom explores every interleaving of the barrier protocol; it runs in release, in its own
    // target dir so the `--cfg loom` build does not evict the normal one.
    let mut c = cargo();
    c.args(["test", "-p", "ferrum-tp", "--release", "--test", "loom"]);
    c.env("RUSTFLAGS", "--cfg loom").env("CARGO_TARGET_DIR", "target/loom");
    t.run("loom model check (ferrum-tp barrier)", c)?;

    if a.gpu {
        // Every crate's `tests/gpu.rs`, and the runner's graph/TP tests under both barriers,
        // ignored (GPU-only) tests, one at a time; NVLink multicast stays off (shared machines
        // must never create multicast objects). With fewer than two GPUs the tp2_* tests are
        // skipped (as bundle/run-gpu-suite.sh does).
        let two_gpus = std::process::Command::new("nvidia-smi")
            .arg("-L")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU")).count() >= 2)
            .unwrap_or(false);
        let suites: &[(&str, &str, &str, bool)] = &[
            ("ferrum-cuda", "gpu", "cuda", false),
            ("ferrum-nccl", "gpu", "cuda", false),
            ("ferrum-graph", "gpu", "cuda", false),
            ("ferrum-runner", "gpu", "cuda", false),
            ("ferrum-runner", "gpu_tp", "cuda", false),
            ("ferrum-runner", "gpu_tp", "cuda,barrier-std", true),
        ];
        for &(pkg, test, features, std_barrier) in suites {
            let mut c = cargo();
            c.args(["test", "-p", pkg, "--release", "--features", features, "--test", test]);
            if std_barrier {
                c.arg("--no-default-features");
            }
            c.args(["--", "--ignored", "--test-threads=1"]);
            if std_barrier {
                c.arg("tp2_");
            }
            if !two_gpus {
                c.args(["--skip", "tp2_", "--skip", "two_gpu"]);
            }
            c.env("NCCL_NVLS_ENABLE", "0");
            t.run(&format!("GPU suite: {pkg} {test} [{features}] (needs a CUDA GPU)"), c)?;
        }
    }
    t.summary();
    Ok(())
}
