//! Stage 1: fingerprints, without locks, in parallel for large requests.
//!
//! With write-once journaling on, the weak hash (xxh3-64) comes first, the pool is asked
//! for every chunk written outside the journal (one hold of the WOJ lock per batch), and
//! crc32c and BLAKE3 run only for the chunks that found no journal copy: a chunk shared
//! with its journal copy takes that copy's crc (their bytes are compared equal first), so
//! the checkpoint half of a `data=journal` stream costs one xxh3 pass and one compare.

use super::defer::Deferral;
use super::executor::{for_each, Executor};
use super::lbas::Lbas;
use super::reduce::{form_jobs, run_job, Job};
use super::{chunk, DataPlan, Plan};
use crate::config::Compression;
use crate::config::BLOCK_SIZE;
use crate::dedup::predictor::Predictor;
use crate::woj::Woj;
use parking_lot::Mutex;
use std::sync::Arc;

/// A plan per chunk of `buf` (chunk `i` goes to `lbas.at(i)`): zero chunks are marked, the
/// others get their weak hash and WOJ candidate (when `woj`), and, when WOJ found no
/// candidate, their crc32c and their BLAKE3 fingerprint (when `dedup`).
pub(crate) fn fingerprint(
    exec: &dyn Executor,
    buf: &[u8],
    dedup: bool,
    woj: Option<&Mutex<Woj>>,
    lbas: &Lbas,
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
            let mut d = DataPlan::new(mask.map_or(0, |m| xxhash_rust::xxh3::xxh3_64(c) & m));
            if blake_now {
                d.hash = *blake3::hash(c).as_bytes();
                d.hashed = true;
            }
            if now {
                d.ensure_crc(c);
            }
            *p = Plan::Data(d);
        }
    });
    let Some(woj) = woj else { return plans };
    {
        let mut w = woj.lock();
        if !w.is_empty() {
            for (i, p) in plans.iter_mut().enumerate() {
                if let Plan::Data(d) = p {
                    d.journal = w.j_of(lbas.at(i)).is_some();
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

/// Chunks one work item of the predicted pass takes at most: a multiple of the largest
/// extent, so cutting a long run into items keeps its extents whole.
const PIECE_CHUNKS_MAX: usize = 64;

/// Stage 1 with the unique-chunk predictor (dedup on, write-once journaling off): the zero
/// check and the cheap hash (xxh3-64) of every chunk, the predictor's guess for each (a
/// repeat of an earlier chunk of the batch is guessed a duplicate), then one parallel pass
/// that fingerprints every chunk (crc32c, BLAKE3) and, for runs of chunks predicted
/// unique, also probes and compresses them as stage 3 would (extents inside one request,
/// singles otherwise). Returns the plans and the early compression jobs, which stage 3
/// adopts for the chunks the index confirms unique.
#[expect(clippy::too_many_arguments, reason = "the stage's executor, predictor, settings and batch")]
pub(crate) fn fingerprint_predicted(
    exec: &dyn Executor,
    buf: &[u8],
    lbas: &Lbas,
    predictor: &Mutex<Predictor>,
    compression: Compression,
    level: i8,
    extent_max: u8,
    defer: Option<&Arc<Deferral>>,
) -> (Vec<Plan>, Vec<Job>) {
    let n = buf.len() / BLOCK_SIZE;
    let mut plans: Vec<Plan> = Vec::with_capacity(n);
    plans.resize_with(n, || Plan::Zero);
    for_each(exec, &mut plans, |i, p| {
        let c = chunk(buf, i);
        if !crate::codec::is_zero(c) {
            let mut d = DataPlan::new(xxhash_rust::xxh3::xxh3_64(c));
            d.predicted_unique = Some(false);
            *p = Plan::Data(d);
        }
    });
    {
        let pr = predictor.lock();
        let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::with_capacity(n);
        for p in plans.iter_mut() {
            if let Plan::Data(d) = p {
                let fresh = seen.insert(d.weak);
                d.predicted_unique = Some(fresh && pr.predict_unique(d.weak));
            }
        }
    }
    // Work items: maximal ranges of one guess inside one request, cut at PIECE_CHUNKS_MAX.
    let unique_at =
        |plans: &[Plan], i: usize| matches!(plans.get(i), Some(Plan::Data(d)) if d.predicted_unique == Some(true));
    let mut bounds: Vec<(usize, usize, bool)> = Vec::new();
    let mut i = 0;
    while i < n {
        let u = unique_at(&plans, i);
        let mut end = i + 1;
        while end < n && end - i < PIECE_CHUNKS_MAX && unique_at(&plans, end) == u && lbas.continues(end) {
            end += 1;
        }
        bounds.push((i, end, u));
        i = end;
    }
    struct Piece<'a> {
        plans: &'a mut [Plan],
        first: usize,
        unique: bool,
        jobs: Vec<Job>,
    }
    let mut pieces: Vec<Piece<'_>> = Vec::with_capacity(bounds.len());
    let mut rest: &mut [Plan] = &mut plans;
    for &(first, end, unique) in &bounds {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(end - first);
        pieces.push(Piece { plans: head, first, unique, jobs: Vec::new() });
        rest = tail;
    }
    let compressing = compression != Compression::None;
    let width = exec.width();
    // Each item is one job already: the pieces share the pool between them.
    for_each(exec, &mut pieces, |_, piece| {
        for (k, p) in piece.plans.iter_mut().enumerate() {
            if let Plan::Data(d) = p {
                let c = chunk(buf, piece.first + k);
                d.ensure_crc(c);
                d.hash = *blake3::hash(c).as_bytes();
                d.hashed = true;
                if piece.unique && compressing {
                    d.incompressible = crate::data::packer::incompressible(c);
                    d.probed = true;
                }
            }
        }
        if !piece.unique {
            return;
        }
        let member = |p: &Plan| compressing && matches!(p, Plan::Data(d) if !d.incompressible);
        let single = |p: &Plan| matches!(p, Plan::Data(_));
        piece.jobs = form_jobs(piece.plans, piece.first, lbas, extent_max, compression, member, single);
        // One backlog per piece: the pieces of a batch run side by side, each a worker's.
        let backlog = Deferral::assign(defer, &mut piece.jobs, width);
        let probed: &[Plan] = piece.plans;
        for job in &mut piece.jobs {
            let t = if defer.is_some() { Deferral::thread_cpu_ns() } else { 0 };
            run_job(
                job,
                level,
                buf,
                |k| matches!(probed.get(k - piece.first), Some(Plan::Data(d)) if d.incompressible),
            );
            if defer.is_some() && job.codec == compression {
                Deferral::note_cost(defer, job.n, Deferral::thread_cpu_ns().saturating_sub(t));
            }
        }
        drop(backlog);
    });
    let jobs = pieces.into_iter().flat_map(|p| p.jobs).collect();
    (plans, jobs)
}
