//! Where the pipeline's parallel work runs: behind the `Executor` trait. The compute work
//! of stages 1 and 3 goes through the `Offload` backend (`offload`), whose CPU backend
//! runs here too; verification reads, the probe and record page reads run here directly.
//!
//! Invariants:
//! - `run_all` returns only when every job has finished: stages borrow the request's
//!   buffers, which must outlive the jobs.
//! - The pool is made once per volume (persistent threads); a request never spawns one.
//! - Small requests stay on the caller's thread: handing 4 KiB to another core costs more
//!   than hashing it; so does work handed out from a job already on the pool. Small is
//!   counted in chunks of work, not in elements (`for_each_weighted`: an extent is up to
//!   16 chunks).
//! - A pool made for an explicit worker count (`CpuPool::with_workers`) runs every large
//!   stage on its own threads, even when it has one: the stages' work then never exceeds
//!   that many threads, whatever number of writers call in.

/// Runs a stage's jobs.
pub(crate) trait Executor: Send + Sync {
    /// Runs every job, in parallel where it can, and returns when all have finished.
    fn run_all(&self, jobs: Vec<Box<dyn FnOnce() + Send + '_>>);
    /// Jobs worth splitting a stage into (1: run on the caller's thread).
    fn width(&self) -> usize;
    /// True when a large stage goes to the executor's own threads even when it has only
    /// one (`width` 1): a volume given an explicit worker count runs its stages on exactly
    /// that many threads, whatever number of writers feed them.
    fn dedicated(&self) -> bool {
        false
    }
}

/// Chunks per request below which a stage stays on the calling thread.
pub(crate) const PARALLEL_CHUNKS_MIN: usize = 64;
/// Jobs a parallel stage is cut into per worker.
const JOBS_PER_WORKER: usize = 4;
/// Threads one volume's pipeline uses at most.
const POOL_THREADS_MAX: usize = 8;

/// Runs `f` on every element, splitting large slices across the executor's workers (one
/// request from a single-threaded client, such as an import, still uses every core).
pub(crate) fn for_each<T: Send>(exec: &dyn Executor, items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    for_each_group(exec, items, 1, |i, g| {
        for (j, t) in g.iter_mut().enumerate() {
            f(i + j, t);
        }
    });
}

/// `for_each` on elements of unequal size, `chunks` being the work of all of them counted
/// in chunks: that, not the number of elements, decides whether the stage leaves the
/// caller's thread. Why: 16 extents of 16 chunks (a 1 MiB write) are 256 chunks of
/// compression; counted as 16 elements they stayed on the caller's thread, so a single
/// writer (an import) compressed on one core, and a volume with an explicit worker count
/// ran that work outside its workers.
pub(crate) fn for_each_weighted<T: Send>(
    exec: &dyn Executor,
    items: &mut [T],
    chunks: usize,
    f: impl Fn(usize, &mut T) + Sync,
) {
    split(exec, items, 1, chunks, |i, g| {
        for (j, t) in g.iter_mut().enumerate() {
            f(i + j, t);
        }
    });
}

/// `for_each` on runs of up to `group` consecutive elements: `f(i, run)` gets the run
/// starting at element `i`, and every run but a job's last is `group` long (work that is
/// cheaper done on several elements at once, such as hashing them side by side).
pub(crate) fn for_each_group<T: Send>(
    exec: &dyn Executor,
    items: &mut [T],
    group: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunks = items.len();
    split(exec, items, group, chunks, f);
}

/// `for_each_group` of elements worth `chunks` chunks of work in all.
fn split<T: Send>(
    exec: &dyn Executor,
    items: &mut [T],
    group: usize,
    chunks: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let group = group.max(1);
    let width = exec.width();
    let serial = |items: &mut [T]| {
        for (k, run) in items.chunks_mut(group).enumerate() {
            f(k * group, run);
        }
    };
    // One element cannot be split: handing it over only adds a wait, unless the stage
    // must run on the executor's own threads.
    let alone = items.len() < 2 && !exec.dedicated();
    if chunks < PARALLEL_CHUNKS_MIN || items.is_empty() || alone || (width < 2 && !exec.dedicated()) {
        serial(items);
        return;
    }
    if width < 2 {
        // One dedicated worker: the whole stage is its one job.
        let serial = &serial;
        exec.run_all(vec![Box::new(move || serial(items))]);
        return;
    }
    // Several jobs per worker, taken in turn: items cost unequal work (a piece of unique
    // chunks is hashed and compressed, a piece of duplicates only hashed), and equal
    // shares of items left one worker idle while the other finished its share.
    let per = items.len().div_ceil(width * JOBS_PER_WORKER).max(1).next_multiple_of(group);
    let f = &f;
    let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = items
        .chunks_mut(per)
        .enumerate()
        .map(|(k, part)| {
            Box::new(move || {
                for (j, run) in part.chunks_mut(group).enumerate() {
                    f(k * per + j * group, run);
                }
            }) as Box<dyn FnOnce() + Send + '_>
        })
        .collect();
    exec.run_all(jobs);
}

/// A pool of CPU threads, one per process: every volume a process opens (a server of
/// several exports) shares it, so the reduction work of all of them is spread over the
/// cores once, not once per volume.
pub(crate) struct CpuPool {
    /// None when the machine has one core or the pool could not be built: jobs then run
    /// on the caller's thread.
    pool: Option<rayon::ThreadPool>,
    width: usize,
    /// Made for an explicit worker count (`with_workers`): stages always run on its
    /// threads, even a single one.
    dedicated: bool,
}

impl CpuPool {
    /// The process's pool, built at first use.
    pub(crate) fn shared() -> std::sync::Arc<CpuPool> {
        static POOL: std::sync::OnceLock<std::sync::Arc<CpuPool>> = std::sync::OnceLock::new();
        POOL.get_or_init(|| std::sync::Arc::new(CpuPool::new())).clone()
    }

    /// A pool as wide as the cores this process may use (at most `POOL_THREADS_MAX`).
    pub(crate) fn new() -> Self {
        Self::with_width(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// A pool of `width` threads (at most `POOL_THREADS_MAX`; 1: jobs run on the caller's
    /// thread): the process's shared pool.
    pub(crate) fn with_width(width: usize) -> Self {
        let width = width.clamp(1, POOL_THREADS_MAX);
        let pool = (width >= 2).then(|| threads(width)).flatten();
        let width = if pool.is_some() { width } else { 1 };
        CpuPool { pool, width, dedicated: false }
    }

    /// A volume's own pool of exactly `workers` threads (at most `POOL_THREADS_MAX`), one
    /// included: its large stages never run on the writers' threads, so the stages' work
    /// is bounded by the workers however many writers feed them (`OpenOptions::workers`;
    /// the benchmark of how the stages scale from one worker to two). Falls back to the
    /// caller's thread if the threads cannot be made.
    pub(crate) fn with_workers(workers: usize) -> Self {
        let width = workers.clamp(1, POOL_THREADS_MAX);
        match threads(width) {
            Some(pool) => CpuPool { pool: Some(pool), width, dedicated: true },
            None => CpuPool { pool: None, width: 1, dedicated: false },
        }
    }
}

/// `width` named pool threads, or None when they cannot be made.
fn threads(width: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new().num_threads(width).thread_name(|i| format!("dedupvol-cpu-{i}")).build().ok()
}

impl Executor for CpuPool {
    fn run_all(&self, jobs: Vec<Box<dyn FnOnce() + Send + '_>>) {
        match &self.pool {
            Some(pool) => pool.scope(|s| {
                for job in jobs {
                    s.spawn(move |_| job());
                }
            }),
            None => jobs.into_iter().for_each(|job| job()),
        }
    }

    fn width(&self) -> usize {
        // Work handed out from one of the pool's own jobs stays on its thread: the caller
        // split the batch already (the predictor's pieces hand their chunks to the backend).
        match &self.pool {
            Some(p) if p.current_thread_index().is_some() => 1,
            _ => self.width,
        }
    }

    fn dedicated(&self) -> bool {
        // Not from one of its own jobs: that work stays where it is (see `width`).
        self.dedicated && self.pool.as_ref().is_some_and(|p| p.current_thread_index().is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_is_visited_once_with_its_index() {
        let pool = CpuPool::new();
        for n in [0usize, 1, 63, 64, 65, 1000, 1024] {
            let mut v = vec![usize::MAX; n];
            for_each(&pool, &mut v, |i, x| *x = i);
            assert!(v.iter().enumerate().all(|(i, &x)| i == x), "n = {n}");
        }
    }

    #[test]
    fn one_dedicated_worker_takes_large_stages_off_the_callers_thread() {
        let pool = CpuPool::with_workers(1);
        assert_eq!(pool.width(), 1);
        let caller = std::thread::current().id();
        for (n, off_caller) in [(PARALLEL_CHUNKS_MIN - 1, false), (PARALLEL_CHUNKS_MIN, true), (1000, true)] {
            let mut v: Vec<Option<(usize, std::thread::ThreadId)>> = vec![None; n];
            for_each(&pool, &mut v, |i, x| *x = Some((i, std::thread::current().id())));
            let threads: std::collections::HashSet<_> = v.iter().flatten().map(|&(_, t)| t).collect();
            assert!(v.iter().enumerate().all(|(i, x)| x.is_some_and(|(j, _)| j == i)), "n = {n}");
            assert_eq!(threads.len(), 1, "n = {n}: one worker, one thread");
            assert_eq!(!threads.contains(&caller), off_caller, "n = {n}");
        }
        // The shared pool's semantics are unchanged: one core's worth runs on the caller.
        let inline = CpuPool::with_width(1);
        let mut v = vec![None; 1000];
        for_each(&inline, &mut v, |_, x| *x = Some(std::thread::current().id()));
        assert!(v.iter().all(|t| *t == Some(caller)));
    }

    /// Elements of unequal size leave the caller's thread by the work they weigh, not by
    /// their number: 16 extents of 16 chunks (a 1 MiB write) ran on the caller's thread,
    /// so a single writer compressed on one core, and a volume given one worker ran its
    /// compression outside it.
    #[test]
    fn weighted_elements_leave_the_callers_thread_by_their_work() {
        let caller = std::thread::current().id();
        let ran_on = |pool: &CpuPool, items: usize, chunks: usize| {
            let mut v: Vec<Option<(usize, std::thread::ThreadId)>> = vec![None; items];
            for_each_weighted(pool, &mut v, chunks, |i, x| *x = Some((i, std::thread::current().id())));
            assert!(v.iter().enumerate().all(|(i, x)| x.is_some_and(|(j, _)| j == i)), "{items} items");
            v.iter().flatten().map(|&(_, t)| t).collect::<std::collections::HashSet<_>>()
        };
        let one = CpuPool::with_workers(1);
        assert!(!ran_on(&one, 16, 256).contains(&caller), "a dedicated worker's 256 chunks ran on the caller");
        assert!(ran_on(&one, 16, 32).contains(&caller), "32 chunks of work left the caller's thread");
        let two = CpuPool::with_width(2);
        if two.width() == 2 {
            assert!(!ran_on(&two, 16, 256).contains(&caller), "256 chunks of work stayed on the caller's thread");
            assert_eq!(ran_on(&two, 1, 256), [caller].into_iter().collect(), "one element was handed over");
        }
    }
}
