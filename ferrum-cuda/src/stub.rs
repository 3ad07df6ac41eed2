//! The API without the `cuda` feature: everything returns [`Error::NotBuilt`].
use crate::error::{Error, Result};
use crate::spec::{CopyBandwidth, CudaModelSpec, DType, DeviceInfo, HostWeights, Projection};
use std::convert::Infallible;

/// Number of CUDA devices (needs the `cuda` feature).
pub fn device_count() -> Result<usize> {
    Err(Error::NotBuilt)
}

/// Device name and memory (needs the `cuda` feature).
pub fn device_info(_ordinal: usize) -> Result<DeviceInfo> {
    Err(Error::NotBuilt)
}

/// Device-to-device copy bandwidth (needs the `cuda` feature).
pub fn measure_copy_bandwidth(_ordinal: usize, _bytes: usize) -> Result<CopyBandwidth> {
    Err(Error::NotBuilt)
}

/// Starts or stops a profiling tool's collection (needs the `cuda` feature).
pub fn profiler_range(_ordinal: usize, _on: bool) -> Result<()> {
    Err(Error::NotBuilt)
}

/// Logits on the device (never constructed without the `cuda` feature).
#[derive(Debug)]
pub struct DeviceLogits {
    never: Infallible,
}

impl DeviceLogits {
    /// Number of logits.
    pub fn len(&self) -> usize {
        match self.never {}
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// The CUDA decode runner (never constructed without the `cuda` feature).
#[derive(Debug)]
pub struct CudaDecodeRunner {
    never: Infallible,
}

impl CudaDecodeRunner {
    /// Uploads weights (needs the `cuda` feature).
    pub fn new(
        _spec: CudaModelSpec,
        _weights: &HostWeights<'_>,
        _dtype: DType,
        _device: usize,
        _progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        Err(Error::NotBuilt)
    }
    /// Random weights on the GPU (needs the `cuda` feature).
    pub fn random(_spec: CudaModelSpec, _dtype: DType, _seed: u64, _device: usize) -> Result<Self> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn spec(&self) -> &CudaModelSpec {
        match self.never {}
    }
    /// See the `cuda` build.
    pub fn dtype(&self) -> DType {
        match self.never {}
    }
    /// See the `cuda` build.
    pub fn set_projection(&mut self, _p: Projection) {}
    /// See the `cuda` build.
    pub fn init_sequence(&mut self, _seq: u64, _capacity: usize) -> Result<()> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn release(&mut self, _seq: u64) -> Result<()> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn sequence_len(&self, _seq: u64) -> Result<usize> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn prefill(&mut self, _seq: u64, _tokens: &[u32]) -> Result<&DeviceLogits> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn decode_step(&mut self, _seq: u64, _token: u32, _position: usize) -> Result<&DeviceLogits> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn logits_to_host(&self, _out: &mut Vec<f32>) -> Result<()> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn argmax(&mut self) -> Result<u32> {
        Err(Error::NotBuilt)
    }
    /// See the `cuda` build.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        Err(Error::NotBuilt)
    }
}
