//! The hot paths allocate nothing: `TpDecodeGroup::decode_step` (caller and
//! rank threads alike) and `AllReduceRank::sum`, counted by a global
//! allocator over the whole process. One test in this binary, so nothing
//! else allocates meanwhile.
#![cfg(not(loom))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ferrum_tp::{CollectiveError, RankContext, RankWorker, SequenceId, StepInput, TpConfig, TpDecodeGroup};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

struct Reducer {
    hidden: Vec<f32>,
}

impl RankWorker for Reducer {
    type Error = CollectiveError;
    fn decode_step(&mut self, ctx: &RankContext, step: StepInput) -> Result<(), CollectiveError> {
        self.hidden.fill(step.token as f32);
        ctx.all_reduce_sum(&mut self.hidden)?;
        ctx.all_reduce_sum(&mut self.hidden)
    }
    fn kv_init(&mut self, _: &RankContext, _: SequenceId) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn kv_release(&mut self, _: &RankContext, _: SequenceId) -> Result<(), CollectiveError> {
        Ok(())
    }
}

#[test]
fn decode_step_and_all_reduce_allocate_nothing() {
    for world in [1, 2, 4] {
        let mut group = TpDecodeGroup::new(TpConfig::new(world).all_reduce_max_len(576), |_| {
            Ok(Reducer { hidden: vec![0.0; 576] })
        })
        .unwrap();
        // Warm up (lazy thread-locals, first park, ...).
        for k in 0..100 {
            group.decode_step(1, k, SequenceId(0)).unwrap();
        }
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        for k in 0..2000 {
            group.decode_step(k as u32, k, SequenceId(0)).unwrap();
        }
        let allocated = ALLOCATIONS.load(Ordering::Relaxed) - before;
        assert_eq!(allocated, 0, "world {world}: {allocated} allocations in 2000 decode steps");
        group.shutdown().unwrap();
    }
}
