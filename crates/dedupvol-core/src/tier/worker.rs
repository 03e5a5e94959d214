//! The tier's background thread: validates the entries found at open, then writes queued
//! promotions in batches — copies first, in runs of consecutive slots, then the slot
//! table pages that cover them.
//!
//! Invariants:
//! - No volume lock is ever taken here; the tier's lock is never held during I/O.
//! - A slot's table record is written only after its copy: a crash between the two
//!   leaves the slot's old record, whose content crc does not match the new copy (ignored
//!   on read, dropped at validation).
//! - A promotion is installed only when its `pending` token is still there when its copy
//!   is written (nothing freed the pbn meanwhile); otherwise its slot is freed again.
//! - A write-path promotion's content must decode to the map entry that made the block
//!   hot, wherever it came from; otherwise it is abandoned.
//! - An entry found at open is validated only if its slot still holds the same occupant
//!   (token) after the data device read.

use super::layout::{self, TIER_RECORDS_PER_PAGE, TIER_RECORD_BYTES};
use super::{Inner, Job, Origin, Shared, PROMOTE_BATCH_MAX};
use crate::config::BLOCK_SIZE;
use crate::io::IoKind;
use crate::read::cache::{new_block, Block};
use parking_lot::MutexGuard;
use std::sync::atomic::Ordering;

/// Entries validated per lock hold.
const VALIDATE_BATCH_MAX: usize = 64;

enum Work {
    Validate(Vec<(u32, u64, u64)>),
    Promote(Vec<Job>),
}

/// The thread's loop: until the tier is dropped.
pub(super) fn run(sh: &Shared) {
    loop {
        let work = {
            let mut g = sh.inner.lock();
            loop {
                if g.stop {
                    return;
                }
                // Busy before the lock is let go, so `wait_idle` never sees an empty queue
                // while a batch taken from it is still unwritten.
                if !g.to_validate.is_empty() {
                    g.busy = true;
                    let n = g.to_validate.len().min(VALIDATE_BATCH_MAX);
                    break Work::Validate(g.to_validate.drain(..n).collect());
                }
                if !g.queue.is_empty() {
                    g.busy = true;
                    let n = g.queue.len().min(PROMOTE_BATCH_MAX);
                    break Work::Promote(g.queue.drain(..n).collect());
                }
                g.busy = false;
                sh.idle.notify_all();
                sh.wake.wait(&mut g);
            }
        };
        match work {
            Work::Validate(items) => validate(sh, items),
            Work::Promote(jobs) => promote(sh, jobs),
        }
    }
}

/// Reads each entry's block from the data device: it serves reads from now on when the
/// content matches the record's crc and nothing replaced or dropped it meanwhile.
fn validate(sh: &Shared, items: Vec<(u32, u64, u64)>) {
    for (slot, pbn, token) in items {
        if sh.disabled.load(Ordering::Relaxed) {
            return;
        }
        let mut buf = vec![0u8; BLOCK_SIZE];
        let crc = sh.data.read(IoKind::TierFill, pbn, &mut buf, "tier slot record").ok().map(|()| crc32c::crc32c(&buf));
        let mut g = sh.inner.lock();
        let Some(m) = g.slots.meta(slot).copied() else { continue };
        if m.token != token {
            continue;
        }
        if crc == Some(m.rec.content_crc) {
            g.slots.validate(slot, token);
        } else {
            g.slots.drop_pbn(pbn);
            if crc.is_some() {
                sh.c.validation_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Voids a job's promotion (removes its pending token when still its own).
fn abandon(g: &mut Inner, job: &Job) {
    if g.pending.get(&job.pbn) == Some(&job.token) {
        g.pending.remove(&job.pbn);
    }
}

/// Writes a batch of promotions.
fn promote(sh: &Shared, jobs: Vec<Job>) {
    // 1. Content: what the job carries, else a read of the data device (no lock held).
    let mut ready: Vec<(Job, Block)> = Vec::with_capacity(jobs.len());
    for mut job in jobs {
        let live = sh.inner.lock().pending.get(&job.pbn) == Some(&job.token);
        if !live {
            continue;
        }
        let block = match job.content.take() {
            Some(b) if b.len() == BLOCK_SIZE => Some(b),
            _ => {
                let mut b = new_block();
                b.get_mut()
                    .and_then(|buf| sh.data.read(IoKind::TierFill, job.pbn, buf, "tier promotion").ok())
                    .map(|()| b)
            }
        };
        match block.filter(|b| decodes_to(b, job.pbn, job.check)) {
            Some(b) => ready.push((job, b)),
            None => abandon(&mut sh.inner.lock(), &job),
        }
    }
    // 2. Slots from the clock hand, and generations.
    let mut placed: Vec<(u32, u64, Job, Block)> = Vec::with_capacity(ready.len());
    {
        let mut g = sh.inner.lock();
        for (job, b) in ready {
            if sh.disabled.load(Ordering::Relaxed) {
                abandon(&mut g, &job);
                continue;
            }
            let slot = if job.origin == Origin::Fill { g.slots.allocate_free() } else { g.slots.allocate() };
            match slot {
                Some(slot) => {
                    let gen = g.next_gen;
                    g.next_gen += 1;
                    placed.push((slot, gen, job, b));
                }
                None => {
                    // A fill finding no free slot is simply not made.
                    if job.origin != Origin::Fill {
                        sh.c.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    abandon(&mut g, &job);
                }
            }
        }
    }
    placed.sort_unstable_by_key(|(slot, ..)| *slot);
    // 3. Copies, consecutive slots in one request.
    let mut written = vec![false; placed.len()];
    let mut i = 0;
    while i < placed.len() {
        let first = placed.get(i).map_or(0, |p| p.0);
        let run = placed.iter().skip(i).zip(first..).take_while(|(p, want)| p.0 == *want).count().max(1);
        let bufs: Vec<&[u8]> = placed.iter().skip(i).take(run).map(|p| &p.3[..]).collect();
        let ok = sh.dev.write_vectored_at(&bufs, sh.geo.slot_offset(u64::from(first))).is_ok();
        if ok {
            sh.c.slot_bytes_written.fetch_add((run * BLOCK_SIZE) as u64, Ordering::Relaxed);
        } else {
            sh.device_error();
        }
        for w in written.iter_mut().skip(i).take(run) {
            *w = ok;
        }
        i += run;
    }
    // 4. Install what is still wanted; encode the table pages covering every slot touched.
    let pages = {
        let mut g = sh.inner.lock();
        let disabled = sh.disabled.load(Ordering::Relaxed);
        let mut pages: Vec<u64> = Vec::new();
        for ((slot, gen, job, b), ok) in placed.iter().zip(&written) {
            let live = g.pending.get(&job.pbn) == Some(&job.token);
            abandon(&mut g, job);
            if *ok && live && !disabled {
                let rec = layout::SlotRecord {
                    pbn: job.pbn,
                    generation: *gen,
                    content_crc: crc32c::crc32c(b),
                    packed: job.packed,
                    refs: job.refs,
                };
                g.slots.install(*slot, rec, super::SlotState::Valid);
                let counter = match job.origin {
                    Origin::Refs => &sh.c.promotions_write,
                    Origin::Read => &sh.c.promotions_read,
                    Origin::Fill => &sh.c.fills,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            } else {
                g.slots.release(*slot);
            }
            let page = u64::from(*slot) / TIER_RECORDS_PER_PAGE as u64;
            if pages.last() != Some(&page) {
                pages.push(page);
            }
        }
        encode_pages(&g, &pages)
    };
    // 5. The table pages, after the copies.
    for (page, buf) in pages {
        if sh.dev.write_at(&buf, sh.geo.page_offset(page)).is_err() {
            sh.device_error();
        }
    }
}

/// True when `block` holds the content `check` (crc, packed slot) names, or nothing is to
/// be checked.
fn decodes_to(block: &[u8], pbn: u64, check: Option<(u32, Option<crate::metadata::block_map::Frag>)>) -> bool {
    match check {
        None => true,
        Some((crc, None)) => crc32c::crc32c(block) == crc,
        // Only fragments inside one block are promoted with a check.
        Some((crc, Some(f))) => {
            let mut out = vec![0u8; BLOCK_SIZE];
            f.span() == 1
                && crate::data::packer::decode_block(pbn, &f, block, &mut out).is_ok()
                && crc32c::crc32c(&out) == crc
        }
    }
}

/// The current records of table pages `pages`, encoded.
fn encode_pages(g: &MutexGuard<'_, Inner>, pages: &[u64]) -> Vec<(u64, Vec<u8>)> {
    pages
        .iter()
        .map(|&page| {
            let mut buf = vec![0u8; BLOCK_SIZE];
            for (i, dst) in buf.chunks_exact_mut(TIER_RECORD_BYTES).enumerate() {
                let slot = page * TIER_RECORDS_PER_PAGE as u64 + i as u64;
                let rec = u32::try_from(slot).ok().and_then(|s| g.slots.record(s));
                layout::encode_record(slot, rec.as_ref(), dst);
            }
            (page, buf)
        })
        .collect()
}
