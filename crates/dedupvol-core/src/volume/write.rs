//! The write path's driver: a batch of whole blocks through the pipeline's stages, the
//! read-modify-write of partial blocks, and what follows a write (hand-off of full staging
//! buffers, FUA and policy commits).

use super::Volume;
use crate::config::{WritePolicy, BLOCK_SIZE};
use crate::data::writer::{write_ticketed, Batch};
use crate::error::{Error, Result};
use crate::pipeline::batcher::{self, Outcome, Stage};
use crate::pipeline::fingerprint::{fingerprint, fingerprint_predicted};
use crate::pipeline::lbas::Lbas;
use crate::pipeline::{reduce, Plan};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Data blocks staged before they are handed to the data writer as one merged write
/// (256 KiB).
const STAGED_BLOCKS_MAX: usize = 64;

impl Volume {
    /// Commits when the write must be durable (FUA, sync policy) or the journal's pending
    /// entries call for it.
    pub(crate) fn after_write(&self, fua: bool, last_seq: u64) -> Result<()> {
        let must = fua || self.policy == WritePolicy::Sync;
        let pressure = self.journal_pressure.load(Ordering::Acquire);
        if must {
            // A FUA write must also cover an earlier identical write it was found equal to,
            // so commit everything pending rather than only this request's entries.
            let target = self.state.lock().journal.last_assigned_seq().max(last_seq);
            self.commit_to(target)
        } else if pressure {
            self.commit_if_pressed()
        } else {
            Ok(())
        }
    }

    /// Read-modify-write of part of one block.
    pub(crate) fn rmw(&self, lba: u64, within: usize, piece: &[u8]) -> Result<u64> {
        let _g = self.rmw_stripe(lba).lock();
        let mut block = vec![0u8; BLOCK_SIZE];
        self.read_blocks(lba, 1, &mut block, None)?;
        block
            .get_mut(within..within + piece.len())
            .ok_or_else(|| {
                Error::internal(
                    "partial write outside its block",
                    format!("logical block {lba}: bytes {within}..{}", within + piece.len()),
                )
            })?
            .copy_from_slice(piece);
        self.write_blocks(lba, &block)
    }

    /// The read-modify-write lock of `lba`'s stripe.
    #[expect(clippy::indexing_slicing, reason = "the index is taken modulo the array's length")]
    fn rmw_stripe(&self, lba: u64) -> &crate::sync::Mutex<()> {
        &self.rmw[(lba % super::RMW_STRIPES as u64) as usize]
    }

    /// Writes whole blocks starting at `lba`; returns the last journal sequence used.
    /// When the volume is full but freed blocks await a commit, commits and retries once
    /// (blocks already applied are rewritten with the same content, which is a no-op).
    /// Small writes are combined with others into one batch (`pipeline::batcher`); a
    /// batch that fails has its requests written alone, here.
    pub(crate) fn write_blocks(&self, lba0: u64, buf: &[u8]) -> Result<u64> {
        if self.batcher.takes(buf.len() / BLOCK_SIZE) {
            let run = |b: &batcher::Batch| {
                // Each request's last sequence is the batch's: a FUA write then commits the
                // whole batch, a superset of what it needs.
                self.write_batch_once(&b.lbas, &b.buf).map(|seq| vec![seq; b.requests()]).map_err(|_| ())
            };
            if let Outcome::Done(seq) = self.batcher.write(lba0, buf, run) {
                return Ok(seq);
            }
        }
        let lbas = Lbas::run(lba0);
        let t = Instant::now();
        let r = match self.write_batch_once(&lbas, buf) {
            Err(Error::NoSpace(_)) if self.state.lock().alloc.pending_len() > 0 => {
                self.flush()?;
                self.write_batch_once(&lbas, buf)
            }
            r => r,
        };
        self.batcher.note_latency(t.elapsed());
        r
    }

    /// One batch through the pipeline (see the module docs of `volume` for the steps):
    /// chunk `i` of `buf` goes to `lbas.at(i)`.
    pub(crate) fn write_batch_once(&self, lbas: &Lbas, buf: &[u8]) -> Result<u64> {
        let n = buf.len() / BLOCK_SIZE;
        let mut t = Instant::now();
        let mut lap = |stage: Stage| {
            let now = Instant::now();
            self.batcher.note_stage(stage, n, now - t);
            t = now;
        };
        // 1. Fingerprints and write-once journaling candidates (no lock; large requests
        //    use every core).
        //    With the unique-chunk predictor, chunks predicted unique are also compressed
        //    in this pass (`early`), which stage 3 adopts where the index agrees.
        let woj = self.woj.as_ref();
        let (mut plans, early) = match &self.predictor {
            Some(pr) => fingerprint_predicted(
                &*self.exec,
                &self.offload,
                buf,
                lbas,
                pr,
                self.compression,
                self.compression_level,
                self.extent_max(),
                self.defer.as_ref(),
            ),
            None => (fingerprint(&*self.exec, &self.offload, buf, self.dedup, woj, lbas), Vec::new()),
        };
        lap(Stage::Fingerprint);
        // 2. Journal copies, then dedup candidates (state lock). Record pages the lookups
        // need are read after the lock is let go, then those chunks are looked up again.
        // The generation of the first hold is kept: it is the older one, so claim judges
        // byte verifications against every reuse since the first lookup.
        let (looked_up_at, woj_dropped, mut fetches, again, source) = {
            let mut st = self.state.lock();
            let dropped = woj.map(|w| reduce::resolve_woj(&mut st, w, buf, &mut plans));
            let (fetches, again) =
                if self.dedup { reduce::find_candidates(&st, buf, &mut plans, None) } else { Default::default() };
            let source = (!fetches.is_empty()).then(|| st.dedup.index().source());
            (st.dedup.generation(), dropped, fetches, again, source)
        };
        if let (Some(w), Some((collisions, stale))) = (woj, woj_dropped) {
            let mut w = w.lock();
            w.stats.collisions += collisions;
            w.stats.stale += stale;
        }
        if let Some(source) = source {
            reduce::read_pages(&*self.exec, &source, &mut fetches);
            if !again.is_empty() {
                let st = self.state.lock();
                reduce::find_candidates(&st, buf, &mut plans, Some(&again));
            }
        }
        lap(Stage::Index);
        // 3. Verification reads and compression (no lock; parallel).
        let mut units = reduce::verify_and_compress(
            &*self.exec,
            &self.offload,
            &self.data,
            &self.cache,
            self.compression,
            self.compression_level,
            self.dedup,
            self.extent_max(),
            buf,
            lbas,
            &mut plans,
            early,
            self.defer.as_ref(),
        );
        lap(Stage::Compress);
        // 4. Claim or place, stage, journal and apply (state lock).
        let mut st = self.state.lock();
        let placed = self.place_batch(&mut st, lbas, buf, &mut plans, &mut units, looked_up_at);
        lap(Stage::Place);
        match placed {
            Ok(seq) => {
                self.note_pressure(&st);
                if let Some(pr) = &self.predictor {
                    // Innermost lock: taken under the state lock, never the other way.
                    score_predictions(&mut pr.lock(), &plans);
                }
                let durable = st.journal.durable_seq();
                let r = st.map.evict(durable);
                self.guard(r)?;
                // 5. A full staging buffer is written after the lock is let go: by the
                // data-writer thread (this writer goes on hashing and compressing), else here.
                let pending = (st.staging.staged_len() >= STAGED_BLOCKS_MAX).then(|| {
                    st.staging.prune(&self.tickets);
                    let ticket = self.tickets.issue();
                    (ticket, st.staging.hand_off(ticket))
                });
                drop(st);
                if let Some((ticket, blocks)) = pending {
                    self.hand_off(ticket, blocks)?;
                }
                Ok(seq)
            }
            // A device error while placing leaves the device state unknown: the volume is
            // failed. Every other error is found before the chunk changes anything (see
            // `apply_entry`), so it fails this request only, never the volume.
            Err(e @ Error::Io { .. }) => self.fail(e),
            Err(e) => Err(e),
        }
    }

    /// Gives a ticketed batch to the data writer, or writes it here (no lock held) when
    /// there is none; its ticket retires either way, failed or not.
    fn hand_off(&self, ticket: u64, blocks: Batch) -> Result<()> {
        let queued = match &self.writer {
            Some(w) => w.submit(ticket, blocks),
            None => Err((ticket, blocks)),
        };
        match queued {
            Ok(()) => self.check_not_failed(),
            Err((ticket, blocks)) => write_ticketed(&self.data, blocks, &[ticket], &self.tickets, &self.health),
        }
    }
}

/// Scores the predictor's guesses for a placed batch against what the index decided, and
/// records every data chunk's cheap hash (a chunk written now is a duplicate's likely
/// original later, whether it was stored or shared).
fn score_predictions(pr: &mut crate::dedup::predictor::Predictor, plans: &[Plan]) {
    for p in plans {
        if let Plan::Data(d) = p {
            if let Some(guess) = d.predicted_unique {
                let stored = reduce::stored(d);
                let wasted = if guess && !stored && d.probed { BLOCK_SIZE as u64 } else { 0 };
                pr.score(guess, stored, wasted);
            }
            pr.insert(d.weak);
        }
    }
}
