//! SIGINT and SIGTERM as a request to stop at the next safe point (used by `import`).
//!
//! The signals are blocked in every thread and received by one thread with `sigwait`, so
//! no engine system call is ever interrupted (EINTR) by them; the copy loop polls
//! `signal()` between chunks. A second signal exits at once: the journal brings the volume
//! back at its next open.
//!
//! Invariants:
//! - `watch` runs before any other thread is started (the mask is inherited by threads
//!   created after it, and a thread created before would still take the signals).

use anyhow::{bail, Context};
use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received (0: none yet).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Blocks SIGINT and SIGTERM in this thread (and the threads it creates later) and starts
/// the thread that receives them.
pub fn watch() -> anyhow::Result<()> {
    // SAFETY: the set is a local, initialised by sigemptyset before use; the calls only
    // write into it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    };
    // SAFETY: `set` is a valid signal set; only this thread's mask changes.
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if r != 0 {
        bail!("blocking SIGINT/SIGTERM: {}", std::io::Error::from_raw_os_error(r));
    }
    std::thread::Builder::new()
        .name("dedupvol-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is a valid signal set blocked in this thread; sigwait writes
            // one int.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                continue;
            }
            if SIGNAL.swap(sig, Ordering::SeqCst) != 0 {
                eprintln!("dedupvol: {} again: exiting without closing the volume (its next open replays the journal)", name(sig));
                std::process::exit(128 + sig);
            }
            eprintln!(
                "dedupvol: {} received: finishing the chunks in progress, then flushing and closing (send it again to exit at once)",
                name(sig)
            );
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// The signal that asked us to stop, if one did.
pub fn signal() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The conventional name of a signal we watch.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}
