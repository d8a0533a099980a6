//! The decode step's threads (`--threads N`): N − 1 workers that wait for a job by spinning on
//! a counter, so that a matmul of a few microseconds can be split without paying a thread
//! wake-up each time (rayon's wake-ups were a sizeable share of a hidden-256 step). A worker
//! that has spun `SPIN_LIMIT` times without a job parks until the next one, so an idle
//! dashboard does not hold the cores. One job runs at a time; a caller that finds the pool busy
//! (another thread decoding) runs its job alone, with the same results: every job splits work
//! by output element, and each element is computed the same way wherever it runs.
//!
//! Each host model's `Kernels` owns one pool, sized when the model loads (`--threads`), and
//! its matmuls, attention and f16 proposal head run on it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;

/// Spins of an idle worker before it parks (tens of microseconds: longer than the gaps
/// between the matmuls of a step, shorter than a human notices a busy core).
const SPIN_LIMIT: u32 = 1 << 16;

/// Spins between two yields of the core, waiting for a job or for the workers: a thread that
/// spins without yielding holds its core for its whole time slice, so where threads outnumber
/// the cores (other processes, or too many threads) the thread with the work waits
/// milliseconds for every job of a few microseconds: with more threads than cores, `spex
/// generate --max-tokens 64` on the shipped model ran many times slower before spinners
/// yielded.
const SPINS_PER_YIELD: u32 = 1 << 8;

/// One spin of a wait loop that has spun `spins` times: a pause, and every
/// [`SPINS_PER_YIELD`] spins the rest of the time slice handed to any thread that wants it.
#[inline]
fn spin_or_yield(spins: u32) {
    if spins % SPINS_PER_YIELD == SPINS_PER_YIELD - 1 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// A job: `f(part)` for every part `0..parts`, the caller running part 0.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

/// A value alone in its cache lines (128 bytes: the adjacent-line prefetcher pairs lines), so
/// that threads writing neighbouring values do not take a line from each other.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The published job and its epoch.
#[derive(Debug, Default)]
struct Mailbox {
    /// Bumped by the caller to publish a job.
    epoch: AtomicU64,
    /// The published job: a pointer to a `Job` on the caller's stack, valid until every
    /// worker has counted itself in `done`.
    job: AtomicUsize,
}

/// What the caller and the workers share; what one side writes and the other polls sits in
/// lines of its own.
struct Shared {
    /// What a worker polls, in one line: the job and its epoch.
    mailbox: Padded<Mailbox>,
    /// Workers that finished the current job.
    done: Padded<AtomicUsize>,
    /// Workers parked on `wake`.
    parked: Padded<AtomicUsize>,
    /// A worker's part of the current job panicked (it still counts itself done).
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

/// The worker threads.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held while a job runs.
    busy: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} threads)", self.threads())
    }
}

impl Pool {
    /// A pool of `threads` threads in all: the caller and `threads − 1` workers; an error if
    /// the system cannot start them.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let mut pool = Self::serial();
        for part in 1..threads.max(1) {
            let shared = pool.shared.clone();
            let worker = std::thread::Builder::new()
                .name(format!("spex-step-{part}"))
                .spawn(move || work(&shared, part))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// A pool of the caller alone: no thread to start.
    pub fn serial() -> Self {
        let shared = Arc::new(Shared {
            mailbox: Padded(Mailbox::default()),
            done: Padded(AtomicUsize::new(0)),
            parked: Padded(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        Self {
            shared,
            workers: Vec::new(),
            busy: Mutex::new(()),
        }
    }

    /// Threads a job is split over, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// `f` of every item, in their order, each item taken by whichever thread is free next:
    /// for jobs of uneven items (a checkpoint's tensors), not for a step's products.
    pub fn map<T: Send, R: Send>(&self, items: Vec<T>, f: &(dyn Fn(T) -> R + Sync)) -> Vec<R> {
        let slots: Vec<Mutex<Slot<T, R>>> = (items.into_iter())
            .map(|item| Mutex::new(Slot::Waiting(item)))
            .collect();
        let next = AtomicUsize::new(0);
        self.run(&|_| {
            while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
                let item = std::mem::replace(&mut *lock(slot), Slot::Taken);
                if let Slot::Waiting(item) = item {
                    let result = f(item);
                    *lock(slot) = Slot::Done(result);
                }
            }
        });
        (slots.into_iter())
            .filter_map(
                |slot| match slot.into_inner().unwrap_or_else(|e| e.into_inner()) {
                    Slot::Done(result) => Some(result),
                    Slot::Waiting(_) | Slot::Taken => None,
                },
            )
            .collect()
    }

    /// Runs `f(part)` for every part in `0..self.threads()`, in parallel where the pool is
    /// free, else one after the other on this thread; returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let workers = self.workers.len();
        let _busy = match self.busy.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..=workers).for_each(f);
                return;
            }
        };
        if workers == 0 {
            f(0);
            return;
        }
        let job = Job { f };
        let s = &*self.shared;
        s.done.store(0, Ordering::SeqCst);
        s.panicked.store(false, Ordering::SeqCst);
        s.mailbox
            .job
            .store(&job as *const Job as usize, Ordering::SeqCst);
        s.mailbox.epoch.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _lock = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // Waits for the workers when dropped, so that even a panic in the caller's part does
        // not unwind past `job` while a worker still reads it.
        // Declared after `_busy`, so dropped first: the pool is free only once they are done.
        let wait = Joined { shared: s, workers };
        f(0);
        drop(wait);
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a decode thread panicked in its part of a step: this is a bug");
        }
    }
}

/// Waits, when dropped, until `workers` workers have finished the current job.
struct Joined<'a> {
    shared: &'a Shared,
    workers: usize,
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.shared.done.load(Ordering::Acquire) < self.workers {
            spin_or_yield(spins);
            spins = spins.wrapping_add(1);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.mailbox.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _lock = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A worker's loop: wait for the next epoch (spinning, then parked), run its part, count
/// itself done.
fn work(s: &Shared, part: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let epoch = loop {
            let epoch = s.mailbox.epoch.load(Ordering::SeqCst);
            if epoch != seen {
                break epoch;
            }
            if spins < SPIN_LIMIT {
                spin_or_yield(spins);
                spins += 1;
                continue;
            }
            let lock = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.parked.fetch_add(1, Ordering::SeqCst);
            let lock = s
                .wake
                .wait_while(lock, |_| s.mailbox.epoch.load(Ordering::SeqCst) == seen)
                .unwrap_or_else(|e| e.into_inner());
            s.parked.fetch_sub(1, Ordering::SeqCst);
            drop(lock);
        };
        seen = epoch;
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        let job = s.mailbox.job.load(Ordering::SeqCst) as *const Job<'static>;
        // SAFETY: the caller published `job` before bumping the epoch this worker saw, and
        // does not return (so the `Job` on its stack lives) until this worker's `done`
        // increment below.
        let f = unsafe { (*job).f };
        // A panic is the caller's to report: the worker counts itself done and stays.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part))).is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

/// `m` locked, whether or not a thread panicked holding it (`Pool::run` reports that panic).
fn lock<S>(m: &Mutex<S>) -> std::sync::MutexGuard<'_, S> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An item of [`Pool::map`]: waiting, being worked on, or its result.
enum Slot<T, R> {
    Waiting(T),
    Taken,
    Done(R),
}

/// The cores this process may run decode threads on: the physical cores (SMT siblings count
/// once) among the CPUs of its affinity mask, at most what the OS says it may use (a
/// container's CPU quota included). The default of `--threads`, and its cap: a decode thread
/// beyond the cores only waits for one.
pub fn available_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores().map_or(logical, |cores| cores.clamp(1, logical))
}

/// The distinct (package, core) pairs of the CPUs this process may run on, from Linux's
/// sysfs topology; `None` where either cannot be read.
#[cfg(target_os = "linux")]
fn physical_cores() -> Option<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a writable cpu_set_t of `size` bytes; pid 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return None;
    }
    let mut cores = std::collections::BTreeSet::new();
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: `cpu` is below CPU_SETSIZE, inside the set.
        if !unsafe { libc::CPU_ISSET(cpu, &set) } {
            continue;
        }
        let topology = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |name: &str| std::fs::read_to_string(format!("{topology}/{name}")).ok();
        let core = (read("physical_package_id")?, read("core_id")?);
        cores.insert(core);
    }
    (!cores.is_empty()).then_some(cores.len())
}

#[cfg(not(target_os = "linux"))]
fn physical_cores() -> Option<usize> {
    None
}

/// The range of `0..n` that part `part` of `parts` takes, its bounds multiples of `align`.
pub fn share(n: usize, parts: usize, part: usize, align: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(align);
    let at = |p: usize| (units * p / parts * align).min(n);
    at(part)..at(part + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_gives_every_result_in_order_on_any_count_of_threads() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).expect("threads");
            let items: Vec<usize> = (0..50).collect();
            let got = pool.map(items, &|i| i * i);
            assert_eq!(
                got,
                (0..50).map(|i| i * i).collect::<Vec<_>>(),
                "{threads} threads"
            );
            assert!(pool.map(Vec::<usize>::new(), &|i| i).is_empty());
        }
    }

    #[test]
    fn a_part_that_panics_is_the_callers_panic_and_the_pool_goes_on() {
        let pool = Pool::new(2).expect("threads");
        for failing in [0, 1] {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(&|part| assert_ne!(part, failing, "part {part} fails"));
            }));
            assert!(run.is_err(), "part {failing}'s panic reaches the caller");
        }
        let hits = AtomicUsize::new(0);
        pool.run(&|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn every_part_runs_once_per_job_and_shares_cover_the_range() {
        let pool = Pool::new(3).expect("threads");
        for _ in 0..1000 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|part| {
                hits[part].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        for (n, parts, align) in [(704, 2, 8), (4096, 3, 16), (7, 2, 8), (0, 2, 4)] {
            let ranges: Vec<_> = (0..parts).map(|p| share(n, parts, p, align)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[parts - 1].end, n);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
