//! Synchronisation shim: `std` in normal builds, [`loom`](https://docs.rs/loom)
//! under `RUSTFLAGS="--cfg loom"`, in the style of tokio's `src/loom/`.
//!
//! Everything in this crate that the model checker must see (the spin-park
//! barrier and the CPU all-reduce) takes its atomics, mutexes, condition
//! variables, threads, spin hints and `UnsafeCell` from here, never from `std`
//! directly. The code under test is therefore *the same code* that ships; only
//! these primitives are swapped.

#[cfg(loom)]
mod imp {
    pub(crate) mod sync {
        pub(crate) use ::loom::sync::{Condvar, Mutex, MutexGuard};

        pub(crate) mod atomic {
            pub(crate) use ::loom::sync::atomic::{AtomicUsize, Ordering};
        }
    }

    pub(crate) mod thread {
        pub(crate) use ::loom::thread::yield_now;
    }

    pub(crate) mod hint {
        pub(crate) use ::loom::hint::spin_loop;
    }

    pub(crate) mod cell {
        pub(crate) use ::loom::cell::UnsafeCell;
    }

    /// Under loom the machine has as many "cores" as the model wants: report a
    /// fixed value so the barrier's backoff policy is deterministic.
    pub(crate) fn available_cores() -> usize {
        1
    }
}

#[cfg(not(loom))]
mod imp {
    pub(crate) mod sync {
        pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

        pub(crate) mod atomic {
            pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};
        }
    }

    pub(crate) mod thread {
        pub(crate) use std::thread::yield_now;
    }

    pub(crate) mod hint {
        pub(crate) use std::hint::spin_loop;
    }

    pub(crate) mod cell {
        /// `std::cell::UnsafeCell` with loom's closure-based access API, so the
        /// same call sites compile against both (loom tracks every access to
        /// detect data races; here the wrapper compiles to nothing).
        #[derive(Debug)]
        pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

        impl<T> UnsafeCell<T> {
            pub(crate) const fn new(value: T) -> Self {
                Self(std::cell::UnsafeCell::new(value))
            }

            /// Shared access through a raw pointer; the caller upholds the
            /// aliasing rules when dereferencing it.
            #[inline(always)]
            pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
                f(self.0.get())
            }

            /// Exclusive access through a raw pointer; the caller upholds the
            /// aliasing rules when dereferencing it.
            #[inline(always)]
            pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
                f(self.0.get())
            }
        }
    }

    /// Cores this process may run on (1 if unknown).
    pub(crate) fn available_cores() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

pub(crate) use imp::*;
