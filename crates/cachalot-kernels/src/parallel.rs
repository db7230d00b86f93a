//! Splitting a kernel's output into rayon tasks, and the shared output those tasks write.
//!
//! Determinism: a task boundary never changes how an output element is computed (each element
//! is produced whole by one task, with the same operations whatever the split), so results do
//! not depend on the thread count.

use std::marker::PhantomData;
use std::ops::Range;

use rayon::prelude::*;

/// Below this many multiply-adds a call runs on the calling thread: rayon's fork/join costs a
/// few microseconds, about what a 128K-element GEMV takes.
const PARALLEL_MIN_WORK: usize = 1 << 17;

/// The same while a [`KeepWarm`] holds the other workers awake: a fork then costs about a
/// microsecond (no wake-up), so a 32K-element product is worth splitting.
const PARALLEL_MIN_WORK_WARM: usize = 1 << 15;

/// Live [`KeepWarm`] guards that started pollers.
static WARM: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Multiply-adds from which a call forks (see [`PARALLEL_MIN_WORK`]).
pub(crate) fn min_parallel_work() -> usize {
    if WARM.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        PARALLEL_MIN_WORK_WARM
    } else {
        PARALLEL_MIN_WORK
    }
}

/// How to cut `0..len` into tasks.
pub(crate) struct Split {
    /// Task boundaries fall on multiples of this (measured from 0).
    pub align: usize,
    /// Smallest and largest task, before rounding up to `align`.
    pub min_task: usize,
    pub max_task: usize,
}

thread_local! {
    /// Set while this thread runs inside [`serial`].
    static SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every kernel called from this thread on this thread alone (no rayon tasks).
/// For callers that already spread independent pieces of work over the pool at a coarser grain
/// (the experts of a batched MoE layer, the sequences of a batch): fork/join per small product
/// would cost more than the product. Results do not change (see the module documentation).
pub fn serial<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SERIAL.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SERIAL.with(|s| s.replace(true)));
    f()
}

/// Whether kernels on this thread may fork rayon tasks (false inside [`serial`]).
pub(crate) fn may_fork() -> bool {
    !SERIAL.with(|s| s.get()) && rayon::current_num_threads() > 1
}

/// Calls `f` on consecutive sub-ranges covering `0..len`: one range when the work (multiply-adds)
/// is small, there is one thread or the caller is inside [`serial`], otherwise about four tasks per thread within the split's
/// bounds, run on rayon's pool.
pub(crate) fn for_each_task(
    len: usize,
    work: usize,
    split: Split,
    f: impl Fn(Range<usize>) + Sync,
) {
    if len == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if !may_fork() || work < min_parallel_work() || len <= split.min_task {
        f(0..len);
        return;
    }
    let target = len
        .div_ceil(threads * 4)
        .clamp(split.min_task, split.max_task.max(split.min_task));
    let task = target.div_ceil(split.align).max(1) * split.align;
    let n_tasks = len.div_ceil(task);
    if n_tasks <= 1 {
        f(0..len);
        return;
    }
    (0..n_tasks)
        .into_par_iter()
        .for_each(|i| f(i * task..((i + 1) * task).min(len)));
}

/// An output slice that several tasks write at the same time, each to its own elements.
///
/// Safety argument: it is built from a `&mut [f32]`, so nothing else can read or write the slice
/// while it lives (the lifetime ties it to that borrow). Each task writes only the elements that
/// belong to its own rows (matmul: `out[t*m + r]` for r in the task's row range) or columns
/// (transposed matmul: `out[t*cols + c]` for c in the task's column range), and the task ranges
/// are disjoint, so no element is written by two tasks and none is read. Indices are
/// bounds-checked.
pub(crate) struct DisjointOut<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: see the type's documentation: concurrent writers touch disjoint elements.
unsafe impl Send for DisjointOut<'_> {}
unsafe impl Sync for DisjointOut<'_> {}

impl<'a> DisjointOut<'a> {
    pub fn new(out: &'a mut [f32]) -> Self {
        DisjointOut {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _borrow: PhantomData,
        }
    }

    /// Writes element `i`.
    ///
    /// # Safety
    /// No other task writes element `i` or holds a slice covering it.
    #[inline]
    pub unsafe fn write(&self, i: usize, v: f32) {
        assert!(i < self.len, "output index {i} out of range {}", self.len);
        self.ptr.add(i).write(v);
    }

    /// The elements `start..start + len` for exclusive use by the calling task.
    ///
    /// # Safety
    /// No other task writes these elements or holds a slice overlapping them while the returned
    /// slice lives.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(
            start <= self.len && len <= self.len - start,
            "output range {start}..{start}+{len} out of range {}",
            self.len
        );
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// While alive, the pool's other workers keep polling for tasks instead of going to sleep
/// between parallel regions. A step of a small model runs dozens of short regions separated
/// by serial work of tens of microseconds; rayon's idle workers sleep after ~32 yields, and
/// waking one costs a futex wake and, on a VM, an inter-processor interrupt — at every region.
/// Hold one for the duration of a step (`Engine::step`); it costs the other cores' idle time.
///
/// Outside the pool, or with one thread, it does nothing. The pollers are rayon jobs that run
/// whatever tasks they find (`rayon::yield_now`) until the guard is dropped; one that the
/// creating worker picks up itself returns at once (it would otherwise wait for its own
/// thread).
pub struct KeepWarm {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether pollers were started (and WARM counts this guard).
    polling: bool,
}

impl KeepWarm {
    pub fn new() -> KeepWarm {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let mut polling = false;
        if let (Some(me), true) = (
            rayon::current_thread_index(),
            rayon::current_num_threads() > 1,
        ) {
            polling = true;
            WARM.fetch_add(1, Ordering::Relaxed);
            for _ in 1..rayon::current_num_threads() {
                let stop = stop.clone();
                rayon::spawn(move || {
                    if rayon::current_thread_index() == Some(me) {
                        return;
                    }
                    while !stop.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            for _ in 0..16 {
                                std::hint::spin_loop();
                            }
                        }
                    }
                });
            }
        }
        KeepWarm { stop, polling }
    }
}

impl Default for KeepWarm {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepWarm {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if self.polling {
            WARM.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
