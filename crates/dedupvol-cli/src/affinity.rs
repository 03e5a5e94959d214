//! Which cores this process runs on, for benchmarks that measure throughput against
//! cores (`bench --mode scaling`).
//!
//! Invariants:
//! - [`confine`] applies to every thread the process has when it is called, and threads
//!   started afterwards inherit the set from the thread that starts them (Linux), so a
//!   volume opened after the call runs every one of its threads inside the set.
//! - A set is never empty: confining to no core is refused, not attempted.

use anyhow::{bail, Context};

/// The cores this process may run on now, in ascending order.
pub fn allowed() -> anyhow::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("reading this process's cores (sched_getaffinity)");
    }
    // SAFETY: CPU_ISSET only reads `set`; every index is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Confines every thread of this process (and the threads they start later) to `cpus`.
pub fn confine(cpus: &[usize]) -> anyhow::Result<()> {
    if cpus.is_empty() {
        bail!("confining the process to no core at all");
    }
    // SAFETY: as in `allowed`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            bail!("core {c} is beyond the largest core number this build knows ({})", libc::CPU_SETSIZE - 1);
        }
        // SAFETY: `c` was checked against CPU_SETSIZE just above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let tasks = std::fs::read_dir("/proc/self/task").context("listing this process's threads (/proc/self/task)")?;
    for t in tasks {
        let t = t.context("listing this process's threads")?;
        // A name that is not a number is not a thread; skip it.
        let Ok(tid) = t.file_name().to_string_lossy().parse::<libc::pid_t>() else { continue };
        // SAFETY: `set` is a valid cpu_set_t of the size passed; a tid of this process.
        let r = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            // A thread that ended since the listing is not an error.
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e).with_context(|| format!("confining thread {tid} to cores {cpus:?}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Confining to one core shows in the allowed set, of this thread and of a thread
    /// started afterwards; restoring gives every core back.
    #[test]
    fn confining_and_restoring_the_cores() {
        let all = allowed().expect("cores");
        assert!(!all.is_empty());
        let first = all.first().copied().expect("a core");
        confine(&[first]).expect("confine");
        assert_eq!(allowed().expect("cores"), vec![first]);
        let seen = std::thread::spawn(allowed).join().expect("thread").expect("cores");
        assert_eq!(seen, vec![first], "a thread started later inherits the set");
        confine(&all).expect("restore");
        assert_eq!(allowed().expect("cores"), all);
        assert!(confine(&[]).is_err());
    }
}
