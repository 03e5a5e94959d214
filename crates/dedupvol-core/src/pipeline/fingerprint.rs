//! Stage 1: fingerprints, without locks, in parallel for large requests.

use super::executor::{for_each, Executor};
use super::{chunk, DataPlan, Plan};
use crate::config::BLOCK_SIZE;
use crate::dedup::Candidate;

/// A plan per chunk of `buf`: zero chunks are marked, the others get their BLAKE3
/// fingerprint (when `dedup`) and their crc32c.
pub(crate) fn fingerprint(exec: &dyn Executor, buf: &[u8], dedup: bool) -> Vec<Plan> {
    let n = buf.len() / BLOCK_SIZE;
    let mut plans: Vec<Plan> = Vec::with_capacity(n);
    plans.resize_with(n, || Plan::Zero);
    for_each(exec, &mut plans, |i, p| {
        let c = chunk(buf, i);
        if !crate::codec::is_zero(c) {
            *p = Plan::Data(DataPlan {
                hash: if dedup { *blake3::hash(c).as_bytes() } else { [0u8; 32] },
                crc: crc32c::crc32c(c),
                cand: Candidate::default(),
                frag: None,
                raw: None,
            });
        }
    });
    plans
}
