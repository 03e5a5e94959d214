//! Stage 1: fingerprints, without locks, in parallel for large requests.
//!
//! With write-once journaling on, the weak hash (xxh3-64) comes first, the pool is asked
//! for every chunk written outside the journal (one hold of the WOJ lock per batch), and
//! crc32c and BLAKE3 run only for the chunks that found no journal copy: a chunk shared
//! with its journal copy takes that copy's crc (their bytes are compared equal first), so
//! the checkpoint half of a `data=journal` stream costs one xxh3 pass and one compare.

use super::executor::{for_each, Executor};
use super::{chunk, DataPlan, Plan};
use crate::config::BLOCK_SIZE;
use crate::dedup::Candidate;
use crate::woj::Woj;
use parking_lot::Mutex;

/// A plan per chunk of `buf` (whose first block is `lba0`): zero chunks are marked, the
/// others get their weak hash and WOJ candidate (when `woj`), and, when WOJ found no
/// candidate, their crc32c and their BLAKE3 fingerprint (when `dedup`).
pub(crate) fn fingerprint(
    exec: &dyn Executor,
    buf: &[u8],
    dedup: bool,
    woj: Option<&Mutex<Woj>>,
    lba0: u64,
) -> Vec<Plan> {
    let n = buf.len() / BLOCK_SIZE;
    let mut plans: Vec<Plan> = Vec::with_capacity(n);
    plans.resize_with(n, || Plan::Zero);
    let mask = woj.map(|w| w.lock().mask());
    // Without WOJ everything is computed in one pass.
    let now = mask.is_none();
    let blake_now = dedup && now;
    for_each(exec, &mut plans, |i, p| {
        let c = chunk(buf, i);
        if !crate::codec::is_zero(c) {
            *p = Plan::Data(DataPlan {
                hash: if blake_now { *blake3::hash(c).as_bytes() } else { [0u8; 32] },
                hashed: blake_now,
                weak: mask.map_or(0, |m| xxhash_rust::xxh3::xxh3_64(c) & m),
                woj: None,
                journal: false,
                crc: if now { crc32c::crc32c(c) } else { 0 },
                crc_done: now,
                cand: Candidate::default(),
                frag: None,
                unit: None,
                incompressible: false,
                batch_dup: false,
                raw: None,
            });
        }
    });
    let Some(woj) = woj else { return plans };
    {
        let mut w = woj.lock();
        if !w.is_empty() {
            for (i, p) in plans.iter_mut().enumerate() {
                if let Plan::Data(d) = p {
                    d.journal = w.j_of(lba0 + i as u64).is_some();
                    if !d.journal {
                        d.woj = w.lookup(d.weak);
                    }
                }
            }
        }
    }
    for_each(exec, &mut plans, |i, p| {
        if let Plan::Data(d) = p {
            if d.woj.is_none() {
                let c = chunk(buf, i);
                d.ensure_crc(c);
                if dedup {
                    d.hash = *blake3::hash(c).as_bytes();
                    d.hashed = true;
                }
            }
        }
    });
    plans
}
