//! `cargo xtask …`: the project's automation, in plain Rust.
//!
//! - `cargo xtask ci [--gpu]`: format check, clippy (warnings denied), the PTX check, all tests;
//!   `--gpu` also runs the GPU-only tests (needs a CUDA GPU).
//! - `cargo xtask ptx [--check]`: builds the CUDA kernels to PTX (see `ptx.rs`).
//! - `cargo xtask gpu-bundle [--cuda-only]`: builds the GPU suite into `bundle/` (see `bundle.rs`).
use anyhow::Result;
use clap::{Parser, Subcommand};

mod bundle;
mod ci;
mod ptx;

#[derive(Parser)]
#[command(name = "xtask", about = "ferrum's project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run everything CI runs: fmt, clippy, ptx --check, tests (and GPU tests with --gpu).
    Ci(ci::CiArgs),
    /// Build the CUDA kernels to PTX; with --check, verify the committed PTX instead.
    Ptx(ptx::PtxArgs),
    /// Build the GPU test executables and the `ferrum` binary into `bundle/` (release, cuda).
    GpuBundle(bundle::BundleArgs),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Ci(a) => ci::run(a),
        Cmd::Ptx(a) => ptx::run(a),
        Cmd::GpuBundle(a) => bundle::run(a),
    }
}
