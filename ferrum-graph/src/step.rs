//! Step parameters in device memory, read by captured kernels.
//!
//! A decode graph is captured once and replayed for every position, so what changes between
//! steps (the input token, its position, the KV length) cannot be kernel arguments: they live
//! in a small device buffer whose *address* is captured. Before each replay, either write them
//! with [`StepParams::write`] (an asynchronous host-to-device copy, outside capture) or let a
//! kernel write them (e.g. the argmax kernel writes the next token into its slot,
//! [`StepParams::slot`]`(StepValues::TOKEN)`).
//!
//! Device layout (16 bytes, `#[repr(C)]`, four `u32` — read them as `int` if you prefer; values
//! stay below 2^31): `[token, position, kv_len, user]`.

/// The host image of the step parameters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StepValues {
    /// Input token id of this step.
    pub token: u32,
    /// Position of that token in the sequence.
    pub position: u32,
    /// Number of KV entries attention reads this step (usually `position + 1`).
    pub kv_len: u32,
    /// Free for the caller (e.g. a sequence slot).
    pub user: u32,
}

impl StepValues {
    /// Number of `u32` slots.
    pub const SLOTS: usize = 4;
    /// Slot index of `token`.
    pub const TOKEN: usize = 0;
    /// Slot index of `position`.
    pub const POSITION: usize = 1;
    /// Slot index of `kv_len`.
    pub const KV_LEN: usize = 2;
    /// Slot index of `user`.
    pub const USER: usize = 3;

    /// The values for decoding `token` at `position` (`kv_len = position + 1`).
    pub fn decode(token: u32, position: u32) -> Self {
        StepValues { token, position, kv_len: position.saturating_add(1), user: 0 }
    }

    /// As the device array.
    pub fn to_array(self) -> [u32; Self::SLOTS] {
        [self.token, self.position, self.kv_len, self.user]
    }

    /// From the device array.
    pub fn from_array(a: [u32; Self::SLOTS]) -> Self {
        StepValues { token: a[0], position: a[1], kv_len: a[2], user: a[3] }
    }
}

#[cfg(feature = "cuda")]
pub use imp::StepParams;

#[cfg(feature = "cuda")]
mod imp {
    use super::StepValues;
    use crate::error::{GraphError, Result};
    use crate::graph::{driver_err, is_capturing};
    use cudarc::driver::sys as cu;
    use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
    use std::sync::Arc;

    /// The step parameters of one sequence, in a 16-byte device buffer (see the module docs).
    ///
    /// The buffer's address never changes, so graphs captured with kernels that read it serve
    /// every step. Keep the `StepParams` alive as long as any graph that reads it (include
    /// the buffer's device address in your graph-cache key).
    #[derive(Debug)]
    pub struct StepParams {
        buf: CudaSlice<u32>,
        base: cu::CUdeviceptr,
    }

    impl StepParams {
        /// Allocates zeroed step parameters on `stream`'s device.
        pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
            if is_capturing(stream)? {
                return Err(GraphError::WriteDuringCapture);
            }
            let buf = stream.alloc_zeros::<u32>(StepValues::SLOTS).map_err(driver_err("cuMemAlloc (step params)"))?;
            let base = {
                let (p, _record) = buf.device_ptr(stream);
                p
            };
            Ok(StepParams { buf, base })
        }

        /// Writes `values` with an asynchronous host-to-device copy on `stream`, ordered before
        /// the work (graph replays) enqueued after it. The 16 bytes are copied from pageable
        /// memory, which CUDA stages at once, so this returns without waiting for the GPU and
        /// without allocating. Refused while `stream` is capturing
        /// ([`GraphError::WriteDuringCapture`]).
        pub fn write(&mut self, stream: &Arc<CudaStream>, values: StepValues) -> Result<()> {
            if is_capturing(stream)? {
                return Err(GraphError::WriteDuringCapture);
            }
            stream.memcpy_htod(&values.to_array(), &mut self.buf).map_err(driver_err("cuMemcpyHtoDAsync (step params)"))
        }

        /// Reads the values back (synchronous: waits for `stream`; for tests and debugging).
        pub fn read(&self, stream: &Arc<CudaStream>) -> Result<StepValues> {
            let mut a = [0u32; StepValues::SLOTS];
            stream.memcpy_dtoh(&self.buf, &mut a).map_err(driver_err("cuMemcpyDtoHAsync (step params)"))?;
            stream.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
            Ok(StepValues::from_array(a))
        }

        /// The whole 4-slot buffer (a kernel argument `const unsigned* step`).
        pub fn buffer(&self) -> &CudaSlice<u32> {
            &self.buf
        }

        /// The slot `i` (see the `StepValues` slot constants) as a one-element view.
        pub fn slot(&self, i: usize) -> CudaView<'_, u32> {
            let i = i.min(StepValues::SLOTS - 1);
            self.buf.slice(i..i + 1)
        }

        /// Device address of the buffer (for raw kernel launches and cache keys).
        ///
        /// A raw handle for tests and escape hatches (raw launches); the typed way in is
        /// [`buffer`](Self::buffer) or [`slot`](Self::slot). Public for the integration tests.
        #[doc(hidden)]
        pub fn device_ptr(&self) -> cu::CUdeviceptr {
            self.base
        }

        /// Device address of the `token` slot (a kernel may write the next token there).
        ///
        /// A raw handle for tests and escape hatches, as [`device_ptr`](Self::device_ptr).
        #[doc(hidden)]
        pub fn token_ptr(&self) -> cu::CUdeviceptr {
            self.base + (StepValues::TOKEN * 4) as u64
        }

        /// Device address of the `position` slot.
        ///
        /// A raw handle for tests and escape hatches, as [`device_ptr`](Self::device_ptr).
        #[doc(hidden)]
        pub fn position_ptr(&self) -> cu::CUdeviceptr {
            self.base + (StepValues::POSITION * 4) as u64
        }

        /// Device address of the `kv_len` slot.
        ///
        /// A raw handle for tests and escape hatches, as [`device_ptr`](Self::device_ptr).
        #[doc(hidden)]
        pub fn kv_len_ptr(&self) -> cu::CUdeviceptr {
            self.base + (StepValues::KV_LEN * 4) as u64
        }

        /// The device this lives on.
        pub fn context_ordinal(&self) -> usize {
            self.buf.stream().context().ordinal()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_four_u32() {
        assert_eq!(std::mem::size_of::<StepValues>(), 16);
        let v = StepValues { token: 1, position: 2, kv_len: 3, user: 4 };
        assert_eq!(v.to_array(), [1, 2, 3, 4]);
        assert_eq!(StepValues::from_array(v.to_array()), v);
        assert_eq!(StepValues::decode(7, 9), StepValues { token: 7, position: 9, kv_len: 10, user: 0 });
        assert_eq!(StepValues::decode(0, u32::MAX).kv_len, u32::MAX);
    }
}
