//! Data writes outside the state lock: tickets, the volume's health, and the background
//! thread that writes full staging batches while the writers that filled them go on
//! hashing and compressing (with direct I/O a write blocks for the device; on two cores a
//! writer waiting for it would leave half the machine idle).
//!
//! Invariants:
//! - Every batch written outside the state lock holds a ticket from `Tickets::issue`, and
//!   the ticket stays active until the batch's write has completed or failed; a commit
//!   waits for every ticket issued before it took its journal batch (`wait_below`).
//! - A failed write marks `Health` failed before its ticket retires, so a commit that
//!   waited for the ticket sees the failure and writes no journal for that data.
//! - At most `QUEUE_BATCHES` batches wait for the thread (bounded memory: a writer blocks
//!   while the queue is full); the thread merges at most `MERGE_BATCHES` per write.
//! - Dropping the `DataWriter` writes what is queued, then joins the thread.

use crate::data::placement::DataDevice;
use crate::error::{Error, Result};
use crate::read::cache::Block;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Batches waiting for the data-writer thread at most (with 256 KiB batches, 1 MiB).
const QUEUE_BATCHES: usize = 4;
/// Queued batches the thread merges into one pass (their pbns are usually consecutive,
/// so they become one large device write).
const MERGE_BATCHES: usize = 4;

/// A batch of placed blocks, by pbn.
pub(crate) type Batch = Vec<(u64, Block)>;

/// Whether the volume still accepts writes.
#[derive(Default)]
pub(crate) struct Health {
    failed: AtomicBool,
    failure: Mutex<String>,
}

impl Health {
    /// Records the first failure (later ones keep the first message).
    pub(crate) fn fail(&self, e: &Error) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            *self.failure.lock() = e.to_string();
        }
    }

    /// An error when the volume has failed.
    pub(crate) fn check(&self) -> Result<()> {
        if self.failed.load(Ordering::Acquire) {
            return Err(Error::Failed(self.failure.lock().clone()));
        }
        Ok(())
    }
}

/// Tickets of data writes in flight outside the state lock.
#[derive(Default)]
pub(crate) struct Tickets {
    inner: Mutex<TicketSet>,
    done: Condvar,
}

#[derive(Default)]
struct TicketSet {
    next: u64,
    active: BTreeSet<u64>,
}

impl Tickets {
    /// A new active ticket.
    pub(crate) fn issue(&self) -> u64 {
        let mut g = self.inner.lock();
        let t = g.next;
        g.next += 1;
        g.active.insert(t);
        t
    }

    /// The ticket the next `issue` will return: every write with a smaller one was issued
    /// before this call.
    pub(crate) fn next(&self) -> u64 {
        self.inner.lock().next
    }

    /// Keeps the entries of `items` whose ticket is still active (one lock for all) and
    /// hands the others to `retired`.
    pub(crate) fn retain_active_or<T>(&self, items: &mut Vec<(u64, T)>, mut retired: impl FnMut(T)) {
        let g = self.inner.lock();
        let mut kept = Vec::with_capacity(items.len());
        for (t, item) in items.drain(..) {
            if g.active.contains(&t) {
                kept.push((t, item));
            } else {
                retired(item);
            }
        }
        *items = kept;
    }

    /// Retires finished writes' tickets and wakes commits waiting for them.
    pub(crate) fn retire(&self, done: &[u64]) {
        {
            let mut g = self.inner.lock();
            for t in done {
                g.active.remove(t);
            }
        }
        self.done.notify_all();
    }

    /// Waits until no ticket below `t` is active.
    pub(crate) fn wait_below(&self, t: u64) {
        let mut g = self.inner.lock();
        while g.active.first().is_some_and(|&a| a < t) {
            self.done.wait(&mut g);
        }
    }
}

/// Writes blocks, merging blocks adjacent on the device into one write. With `writeback`,
/// also starts their writeback (buffered storage: the data region is written
/// sequentially, so the device streams it while the commit that will sync it is filling).
pub(crate) fn write_merged(data: &DataDevice, mut blocks: Batch, writeback: bool) -> Result<()> {
    blocks.sort_unstable_by_key(|(p, _)| *p);
    let mut rest = blocks.as_slice();
    while let Some(((start, _), _)) = rest.split_first() {
        let run = 1 + rest.iter().skip(1).zip(1u64..).take_while(|((p, _), k)| *p == start + k).count();
        let (head, tail) = rest.split_at(run);
        let bufs: Vec<&[u8]> = head.iter().map(|(_, b)| &b[..]).collect();
        data.write_run(*start, &bufs)?;
        if writeback {
            data.start_writeback(*start, run as u64);
        }
        rest = tail;
    }
    Ok(())
}

/// The background data-writer thread and its queue.
pub(crate) struct DataWriter {
    tx: Option<SyncSender<(u64, Batch)>>,
    handle: Option<JoinHandle<()>>,
}

impl DataWriter {
    /// Starts the thread; None when it cannot be spawned (writers then write inline).
    pub(crate) fn start(data: DataDevice, tickets: Arc<Tickets>, health: Arc<Health>) -> Option<Self> {
        let (tx, rx) = sync_channel::<(u64, Batch)>(QUEUE_BATCHES);
        let handle = std::thread::Builder::new()
            .name("dedupvol-data".into())
            .spawn(move || run(rx, &data, &tickets, &health))
            .ok()?;
        Some(DataWriter { tx: Some(tx), handle: Some(handle) })
    }

    /// Queues a ticketed batch (blocking while the queue is full); gives it back when the
    /// thread is gone, for the caller to write inline.
    pub(crate) fn submit(&self, ticket: u64, blocks: Batch) -> std::result::Result<(), (u64, Batch)> {
        match &self.tx {
            Some(tx) => tx.send((ticket, blocks)).map_err(|e| e.0),
            None => Err((ticket, blocks)),
        }
    }
}

impl Drop for DataWriter {
    fn drop(&mut self) {
        // Closing the channel lets the thread write what is queued and exit.
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run(rx: Receiver<(u64, Batch)>, data: &DataDevice, tickets: &Tickets, health: &Health) {
    while let Ok((t, mut blocks)) = rx.recv() {
        let mut done = vec![t];
        while done.len() < MERGE_BATCHES {
            match rx.try_recv() {
                Ok((t, more)) => {
                    done.push(t);
                    blocks.extend(more);
                }
                Err(_) => break,
            }
        }
        // The error is recorded in `health`, where the next commit or write finds it.
        let _ = write_ticketed(data, blocks, &done, tickets, health);
    }
}

/// Writes ticketed batches (merged into `blocks`) and retires their tickets, failed or
/// not; a failure is recorded in `health` before the tickets retire, so a commit waiting
/// for them sees it. After a failure nothing more is written: what reached the device is
/// unknown, and the volume refuses every later commit anyway.
pub(crate) fn write_ticketed(
    data: &DataDevice,
    blocks: Batch,
    done: &[u64],
    tickets: &Tickets,
    health: &Health,
) -> Result<()> {
    let r = health.check().and_then(|()| write_merged(data, blocks, true));
    if let Err(e) = &r {
        health.fail(e);
    }
    tickets.retire(done);
    r
}
