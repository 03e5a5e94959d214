//! A mutex whose waiters never yield the CPU in a loop: `std::sync::Mutex` (on Linux a
//! short spin, then a futex wait), with parking_lot's calling convention (`lock` returns
//! the guard; a holder's panic does not poison it).
//!
//! Why not parking_lot's for the hot locks: its waiters spin a little, then call
//! `sched_yield` up to seven times before they sleep. On a small machine, with the client
//! on the same cores, every yield is a trip through the scheduler that hands the core to
//! another waiter or to the client; under contention (four NBD workers taking turns at a
//! connection's socket and at the content cache) those trips took a fifth of the server's
//! CPU on 8-128 KiB random reads. A futex wait sleeps once and is woken once.
//!
//! Used for the NBD connection's socket and request locks and every lock of a volume but
//! its state lock, which keeps parking_lot's for its fairness (see `Volume::state`).
//!
//! Invariants:
//! - A lock taken through this type is never poisoned for its later users, as with
//!   parking_lot: a holder's panic is an engine bug, which the NBD server answers with EIO
//!   for that request while later requests go on from the state the holder left.

use std::sync::{MutexGuard, PoisonError, TryLockError};

/// See the module docs.
#[derive(Default)]
pub struct Mutex<T: ?Sized>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `t`.
    pub const fn new(t: T) -> Self {
        Mutex(std::sync::Mutex::new(t))
    }

    /// The value, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Waits for the lock (no yielding loop) and returns its guard.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The guard, or None when another thread holds the lock.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The value, through a unique reference (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::Mutex;
    use std::sync::Arc;

    #[test]
    fn a_panicking_holder_leaves_the_lock_usable() {
        let m = Arc::new(Mutex::new(1u32));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock();
            *g = 2;
            panic!("holder fails");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*m.lock(), 2);
        assert!(m.try_lock().is_some());
    }

    #[test]
    fn try_lock_fails_while_held_and_counts_stay_exact_under_contention() {
        let m = Arc::new(Mutex::new(0u64));
        {
            let _g = m.lock();
            assert!(m.try_lock().is_none());
        }
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        *m.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*m.lock(), 40_000);
    }
}
