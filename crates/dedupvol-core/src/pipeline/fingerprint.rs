//! Stage 1: fingerprints, without locks, in parallel for large requests.
//!
//! With write-once journaling on, the weak hash (xxh3-64) comes first, the pool is asked
//! for every chunk written outside the journal (one hold of the WOJ lock per batch), and
//! crc32c and BLAKE3 run only for the chunks that found no journal copy: a chunk shared
//! with its journal copy takes that copy's crc (their bytes are compared equal first), so
//! the checkpoint half of a `data=journal` stream costs one xxh3 pass and one compare.
//!
//! The per-chunk work is the offload backend's (`offload::print_chunk` on the CPU): this
//! stage says what to compute for which chunks and turns the answers into plans.

use super::defer::Deferral;
use super::executor::{for_each_weighted, Executor};
use super::lbas::Lbas;
use super::offload::{Offloader, PrintOp, Prints};
use super::reduce::{form_jobs, run_jobs, Job};
use super::{chunk, DataPlan, Plan};
use crate::config::Compression;
use crate::config::BLOCK_SIZE;
use crate::dedup::predictor::Predictor;
use crate::sync::Mutex;
use crate::woj::Woj;
use std::sync::Arc;

/// A plan per chunk of `buf` (chunk `i` goes to `lbas.at(i)`): zero chunks are marked, the
/// others get their weak hash and WOJ candidate (when `woj`), and, when WOJ found no
/// candidate, their crc32c and their BLAKE3 fingerprint (when `dedup`).
pub(crate) fn fingerprint(
    exec: &dyn Executor,
    off: &Offloader,
    buf: &[u8],
    dedup: bool,
    woj: Option<&Mutex<Woj>>,
    lbas: &Lbas,
) -> Vec<Plan> {
    let n = buf.len() / BLOCK_SIZE;
    let mask = woj.map(|w| w.lock().mask());
    // Without WOJ everything is computed in one pass.
    let now = mask.is_none();
    let op = PrintOp { zero_check: true, weak_mask: mask, crc32c: now, blake3: dedup && now };
    let chunks: Vec<&[u8]> = (0..n).map(|i| chunk(buf, i)).collect();
    let prints = off.fingerprint(exec, op, &chunks);
    let mut plans = plans_from(op, &prints);
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
    // The chunks without a journal copy: their crc32c (none has it yet) and BLAKE3.
    let mut rest: Vec<(usize, &mut DataPlan)> = plans
        .iter_mut()
        .enumerate()
        .filter_map(|(i, p)| match p {
            Plan::Data(d) if d.woj.is_none() => Some((i, d)),
            _ => None,
        })
        .collect();
    let op = PrintOp { zero_check: false, weak_mask: None, crc32c: true, blake3: dedup };
    let chunks: Vec<&[u8]> = rest.iter().map(|(i, _)| chunk(buf, *i)).collect();
    let prints = off.fingerprint(exec, op, &chunks);
    for ((_, d), pr) in rest.iter_mut().zip(&prints) {
        take_prints(d, op, pr);
    }
    plans
}

/// Records in `d` the prints `op` asked for (the weak hash is the plan's from the start).
/// A batch's plans from its first fingerprint answers (one per chunk, in order): zero
/// chunks stay `Zero`, the others become data plans holding what `op` computed. On the
/// calling thread: building a plan costs less than handing it to another.
fn plans_from(op: PrintOp, prints: &[Prints]) -> Vec<Plan> {
    prints
        .iter()
        .map(|pr| {
            if pr.zero {
                return Plan::Zero;
            }
            let mut d = DataPlan::new(pr.weak);
            take_prints(&mut d, op, pr);
            Plan::Data(d)
        })
        .collect()
}

fn take_prints(d: &mut DataPlan, op: PrintOp, pr: &Prints) {
    if op.blake3 {
        d.hash = pr.blake3;
        d.hashed = true;
    }
    if op.crc32c {
        d.crc = pr.crc32c;
        d.crc_done = true;
    }
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
#[expect(clippy::too_many_arguments, reason = "the stage's executor, backend, predictor, settings and batch")]
pub(crate) fn fingerprint_predicted(
    exec: &dyn Executor,
    off: &Offloader,
    buf: &[u8],
    lbas: &Lbas,
    predictor: &Mutex<Predictor>,
    compression: Compression,
    level: i8,
    extent_max: u8,
    defer: Option<&Arc<Deferral>>,
) -> (Vec<Plan>, Vec<Job>) {
    let n = buf.len() / BLOCK_SIZE;
    let cheap = PrintOp { zero_check: true, weak_mask: Some(u64::MAX), crc32c: false, blake3: false };
    let chunks: Vec<&[u8]> = (0..n).map(|i| chunk(buf, i)).collect();
    let prints = off.fingerprint(exec, cheap, &chunks);
    let mut plans = plans_from(cheap, &prints);
    for p in &mut plans {
        if let Plan::Data(d) = p {
            d.predicted_unique = Some(false);
        }
    }
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
    let width = off.parallel();
    let strong = PrintOp { zero_check: false, weak_mask: None, crc32c: true, blake3: true };
    // Each item is one job already: the pieces share the pool between them (and the CPU
    // backend runs a piece's calls on the piece's thread). Weighed by the batch's chunks:
    // counted as pieces (up to 64 chunks each), a 4 MiB batch stayed on the caller's thread.
    for_each_weighted(exec, &mut pieces, n, |_, piece| {
        let chunks: Vec<&[u8]> = piece
            .plans
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Plan::Data(_)))
            .map(|(k, _)| chunk(buf, piece.first + k))
            .collect();
        let prints = off.fingerprint(exec, strong, &chunks);
        let mut prints = prints.iter();
        for (k, p) in piece.plans.iter_mut().enumerate() {
            if let Plan::Data(d) = p {
                if let Some(pr) = prints.next() {
                    take_prints(d, strong, pr);
                }
                // A chunk without its prints (none is) would be hashed in stage 3 or 4.
                if piece.unique && compressing {
                    d.incompressible = crate::data::packer::incompressible(chunk(buf, piece.first + k));
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
        let backlog = Deferral::assign(defer, &mut piece.jobs, width, false);
        let probed: &[Plan] = piece.plans;
        let first = piece.first;
        run_jobs(
            exec,
            off,
            &mut piece.jobs,
            level,
            buf,
            |k| matches!(k.checked_sub(first).and_then(|k| probed.get(k)), Some(Plan::Data(d)) if d.incompressible),
            defer,
            compression,
        );
        drop(backlog);
    });
    let jobs = pieces.into_iter().flat_map(|p| p.jobs).collect();
    (plans, jobs)
}
