//! Stages 2 and 3: dedup candidates (under the state lock), then byte verification and
//! compression (no lock, in parallel; the compression itself by the offload backend).

use super::defer::Deferral;
use super::executor::{for_each, Executor};
use super::lbas::Lbas;
use super::offload::{CompressUnit, Offloader};
use super::{chunk, DataPlan, Plan, Unit};
use crate::config::{Compression, BLOCK_SIZE};
use crate::data::packer;
use crate::data::placement::DataDevice;
use crate::dedup::index::{Fetch, PageSource};
use crate::dedup::{verify, Candidate};
use crate::metadata::block_map::UNIT_BLOCKS_MAX;
use crate::read::cache::{Block, ContentCache};
use crate::sync::Mutex;
use crate::volume::state::State;
use crate::woj::Woj;
use std::sync::Arc;

/// Stage 2 (state lock held): each data chunk's dedup candidate, from memory. A candidate
/// not on the device yet (the device may still hold its block's previous life) is verified
/// here, from memory; the others are verified in stage 3. `only`: the chunks to look up
/// (None: all of them, a first lookup). Returns the record pages to read before asking
/// again (without the lock: `read_pages`) and the chunks worth asking again once they are.
pub(crate) fn find_candidates(
    st: &State,
    buf: &[u8],
    plans: &mut [Plan],
    only: Option<&[usize]>,
) -> (Vec<Fetch>, Vec<usize>) {
    let mut fetches: Vec<Fetch> = Vec::new();
    let mut again = Vec::new();
    let mut one = |i: usize, p: &mut Plan| {
        let Plan::Data(d) = p else { return };
        // A chunk with a write-once journaling candidate has no BLAKE3 fingerprint yet.
        if !d.hashed {
            return;
        }
        let (cand, fetch) = st.dedup.lookup(&d.hash, &st.rc, only.is_none());
        if let Some(f) = fetch {
            if cand.loc.is_none() {
                again.push(i);
            }
            // Requests of a batch often name the same page: read it once.
            if !fetches.contains(&f) && fetches.len() < FETCHES_MAX {
                fetches.push(f);
            }
        }
        d.cand = match cand {
            Candidate { loc: Some(loc), verified: false } => {
                let e = loc.entry(0);
                let mut out = [0u8; BLOCK_SIZE];
                match st.unwritten(&e, &mut out) {
                    Some(true) if out == chunk(buf, i) => Candidate { loc: Some(loc), verified: true },
                    Some(_) => Candidate::default(),
                    None => cand,
                }
            }
            _ => cand,
        };
    };
    match only {
        None => plans.iter_mut().enumerate().for_each(|(i, p)| one(i, p)),
        Some(idx) => {
            for &i in idx {
                if let Some(p) = plans.get_mut(i) {
                    one(i, p);
                }
            }
        }
    }
    // A whole chapter read for a sparse hook holds the records written together with the
    // hook's block: every chunk of the batch still without a candidate is worth asking
    // again, not only the hooks (a short duplicate run would keep its hook alone).
    if only.is_none() && fetches.iter().any(|f| f.page.is_none()) {
        again = (0..plans.len())
            .filter(|&i| matches!(plans.get(i), Some(Plan::Data(d)) if d.hashed && d.cand.loc.is_none()))
            .collect();
    }
    (fetches, again)
}

/// Record pages one batch reads for its lookups at most (a batch is at most 1,024 chunks;
/// past this bound the chunks just miss their duplicates).
const FETCHES_MAX: usize = 256;

/// Reads the record pages stage 2 asked for (no lock; in parallel for several).
pub(crate) fn read_pages(exec: &dyn Executor, source: &PageSource, fetches: &mut [Fetch]) {
    for_each(exec, fetches, |_, f| source.fetch(f));
}

/// Stage 3 (no lock): reads and compares the candidates left unverified (write-once
/// journaling's first: a chunk whose journal copy is proven equal needs nothing else),
/// then compresses every chunk without a verified duplicate: runs of consecutive chunks
/// that pass the incompressibility probe as extents (`units`), the rest alone, keeping a
/// raw copy when compression does not pay. A chunk whose journal copy differed gets its
/// BLAKE3 fingerprint here when dedup is on. Returns the batch's extents.
#[expect(clippy::too_many_arguments, reason = "the stage's executor, backend, devices, cache, settings and batch")]
pub(crate) fn verify_and_compress(
    exec: &dyn Executor,
    off: &Offloader,
    data: &DataDevice,
    cache: &Mutex<ContentCache>,
    compression: Compression,
    level: i8,
    dedup: bool,
    extent_max: u8,
    buf: &[u8],
    lbas: &Lbas,
    plans: &mut [Plan],
    early: Vec<Job>,
    defer: Option<&Arc<Deferral>>,
) -> Vec<Unit> {
    // A batch that would take the deferral backlog past its budget goes to the fast codec
    // whole, which decides compressibility itself: the probe is skipped.
    let defer_all = Deferral::defers_all(defer, off.parallel(), plans.len());
    for_each(exec, plans, |i, p| {
        let Plan::Data(d) = p else { return };
        let c = chunk(buf, i);
        if let Some(w) = d.woj.as_mut() {
            match w.entry {
                Some(e) if !w.verified => {
                    let loc = crate::dedup::index::Location::of(&e);
                    w.by_read = !cache.lock().contains(e.pbn);
                    w.verified = verify::by_read(data, cache, loc, c);
                }
                _ => {}
            }
            if w.verified {
                return;
            }
            // Stage 4 counts the collision; the chunk takes the normal path.
        }
        // A chunk whose WOJ candidate fell through (here or in stage 2) has no crc32c nor
        // BLAKE3 yet: both are made here, outside the lock.
        d.ensure_crc(c);
        if dedup && !d.hashed {
            d.hash = *blake3::hash(c).as_bytes();
            d.hashed = true;
        }
        if let Candidate { loc: Some(loc), verified: false } = d.cand {
            d.cand.verified = verify::by_read(data, cache, loc, c);
        }
        if !d.cand.verified && compression != Compression::None && !d.probed && !defer_all {
            d.incompressible = packer::incompressible(c);
        }
    });
    // Repeats inside the batch are shared with their first copy in stage 4 (it is
    // recorded in the index as it is placed): compressing them into an extent would store
    // their bytes for nothing.
    if dedup {
        let mut seen: std::collections::HashSet<[u8; 32]> = std::collections::HashSet::new();
        for p in plans.iter_mut() {
            if let Plan::Data(d) = p {
                if d.hashed && needs_store(d) && !seen.insert(d.hash) {
                    d.batch_dup = true;
                }
            }
        }
    }
    // Stage 1's compression of chunks predicted unique, for those still to store: an
    // extent only if every chunk of it is (else its chunks are compressed again below:
    // the cost of a wrong guess), single chunks one by one.
    let mut adopted: Vec<Job> = Vec::new();
    for mut job in early {
        let range = job.first..job.first + job.n;
        let to_store =
            |p: Option<&Plan>| matches!(p, Some(Plan::Data(d)) if needs_store(d) && !d.batch_dup && !d.journal);
        if job.unit.is_some() {
            if range.clone().all(|k| to_store(plans.get(k))) {
                for k in range {
                    if let Some(Plan::Data(d)) = plans.get_mut(k) {
                        d.early = true;
                    }
                }
                adopted.push(job);
            }
            continue;
        }
        let singles = std::mem::take(&mut job.singles);
        for (k, (frag, raw)) in range.zip(singles) {
            if to_store(plans.get(k)) {
                if let Some(Plan::Data(d)) = plans.get_mut(k) {
                    d.frag = frag;
                    d.frag_codec = job.codec;
                    d.raw = raw;
                    d.early = true;
                }
            }
        }
    }
    // The jobs: extents over runs of compressible chunks to store, single chunks otherwise.
    let member = |p: &Plan| extent_member(p, compression);
    let single = |p: &Plan| matches!(p, Plan::Data(d) if needs_store(d) && !d.batch_dup && !d.early);
    let mut jobs = form_jobs(plans, 0, lbas, extent_max, compression, member, single);
    let backlog = Deferral::assign(defer, &mut jobs, off.parallel(), defer_all);
    let probed: &[Plan] = plans;
    run_jobs(
        exec,
        off,
        &mut jobs,
        level,
        buf,
        |k| matches!(probed.get(k), Some(Plan::Data(d)) if d.incompressible),
        defer,
        compression,
    );
    drop(backlog);
    jobs.splice(0..0, adopted);
    let mut units = Vec::new();
    for job in jobs {
        match job.unit {
            Some(frag) => {
                let u = units.len();
                for (sub, p) in plans.iter_mut().skip(job.first).take(job.n).enumerate() {
                    if let Plan::Data(d) = p {
                        d.unit = Some((u, sub as u8));
                    }
                }
                units.push(Unit { blocks: job.n as u8, frag, codec: job.codec, placed: None });
            }
            None => {
                for (p, (frag, raw)) in plans.iter_mut().skip(job.first).zip(job.singles) {
                    if let Plan::Data(d) = p {
                        d.frag = frag;
                        d.frag_codec = job.codec;
                        d.raw = raw;
                    }
                }
            }
        }
    }
    units
}

/// The compression jobs over `plans` (chunk `offset + k` of the batch is `plans[k]`):
/// runs of `member` chunks inside one request cut into near-equal extents of at most
/// `extent_max`, and every other `single` chunk alone.
pub(crate) fn form_jobs(
    plans: &[Plan],
    offset: usize,
    lbas: &Lbas,
    extent_max: u8,
    codec: Compression,
    member: impl Fn(&Plan) -> bool,
    single: impl Fn(&Plan) -> bool,
) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    let mut i = 0;
    while i < plans.len() {
        // A run of members inside one request (chunks of combined requests never join).
        let run = plans
            .iter()
            .enumerate()
            .skip(i)
            .take_while(|&(k, p)| member(p) && (k == i || lbas.continues(offset + k)))
            .count();
        if run >= 2 && extent_max >= 2 {
            // Units of near-equal size: a run of 20 makes two of 10, not 16 and 4.
            let units = run.div_ceil(usize::from(extent_max.clamp(1, UNIT_BLOCKS_MAX)));
            let size = run.div_ceil(units);
            let mut at = i;
            while at < i + run {
                let n = size.min(i + run - at);
                jobs.push(Job { first: offset + at, n, unit: None, singles: Vec::new(), codec });
                at += n;
            }
            i += run;
            continue;
        }
        if plans.get(i).is_some_and(&single) {
            jobs.push(Job { first: offset + i, n: 1, unit: None, singles: Vec::new(), codec });
        }
        i += 1;
    }
    jobs
}

/// Compresses a batch's jobs with one call to the backend: a unit per job, its extent as a
/// whole or its single chunk (none for a single chunk the probe turned away: its verdict
/// stands; `incompressible(k)` is the verdict on chunk k). Then, in parallel, each job
/// takes its unit's answer: an extent's fragment, a single chunk's fragment, or raw copies
/// of its chunks: an extent that did not save 1/16 as a whole is stored raw (its blocks
/// alone would save less still, measured on the vdi preset's data, and compressing them
/// again doubled the compression work of such data). With deferral on, each job of the
/// volume's codec tells the gauge what it cost (`volume_codec`: the volume's codec).
#[expect(clippy::too_many_arguments, reason = "the stage's executor, backend, jobs, data and gauge")]
pub(crate) fn run_jobs(
    exec: &dyn Executor,
    off: &Offloader,
    jobs: &mut [Job],
    level: i8,
    buf: &[u8],
    incompressible: impl Fn(usize) -> bool,
    defer: Option<&Arc<Deferral>>,
    volume_codec: Compression,
) {
    let mut units: Vec<CompressUnit<'_>> = Vec::with_capacity(jobs.len());
    let mut unit_of: Vec<Option<usize>> = Vec::with_capacity(jobs.len());
    for job in jobs.iter() {
        let wanted = job.n >= 2 || !incompressible(job.first);
        match buf.get(job.first * BLOCK_SIZE..(job.first + job.n) * BLOCK_SIZE).filter(|_| wanted) {
            Some(data) => {
                unit_of.push(Some(units.len()));
                let timed = defer.is_some() && job.codec == volume_codec;
                // A deferred job's LZ4 runs accelerated: what it stores is compressed
                // again at idle, and its speed is what deferral is for.
                let level = if job.codec == volume_codec { level } else { super::defer::DEFER_LZ4_ACCELERATION };
                units.push(CompressUnit { data, codec: job.codec, level, timed });
            }
            None => unit_of.push(None),
        }
    }
    let mut answers = off.compress(exec, &units);
    let mut work: Vec<(&mut Job, Option<Vec<u8>>, u64)> = jobs
        .iter_mut()
        .zip(unit_of)
        .map(|(job, u)| match u.and_then(|u| answers.get_mut(u)) {
            Some(a) => (job, a.bytes.take(), a.busy_ns),
            None => (job, None, 0),
        })
        .collect();
    for_each(exec, &mut work, |_, (job, frag, busy_ns)| {
        if defer.is_some() && job.codec == volume_codec {
            Deferral::note_cost(defer, job.n, *busy_ns);
        }
        let frag = frag.take();
        if job.n >= 2 && frag.is_some() {
            job.unit = frag;
            return;
        }
        let mut frag = frag;
        job.singles = (job.first..job.first + job.n)
            .map(|k| match frag.take() {
                Some(f) => (Some(f), None),
                None => (None, Some(Block::from(chunk(buf, k)))),
            })
            .collect();
    });
}

/// True when stage 4 stores the chunk rather than sharing a copy (as far as the stages
/// before it can tell: a candidate that went stale meanwhile is stored after all).
pub(crate) fn stored(d: &DataPlan) -> bool {
    needs_store(d) && !d.batch_dup
}

/// True when the chunk must be stored (no verified duplicate of any kind).
fn needs_store(d: &DataPlan) -> bool {
    !d.cand.verified && !d.woj.as_ref().is_some_and(|w| w.verified)
}

/// True when the chunk may join an extent: stored, compressible by the probe, and not a
/// file-system journal block (whose stored copy checkpoint writes compare with).
fn extent_member(p: &Plan, compression: Compression) -> bool {
    compression != Compression::None
        && matches!(p, Plan::Data(d) if needs_store(d) && !d.incompressible && !d.journal && !d.batch_dup && !d.early)
}

/// One compression job (stage 3, or stage 1 for chunks predicted unique): an extent of `n`
/// chunks from `first`, or (`n` = 1, or an extent that did not compress) its chunks one
/// by one.
pub(crate) struct Job {
    pub(crate) first: usize,
    pub(crate) n: usize,
    /// The compressed extent.
    pub(crate) unit: Option<Vec<u8>>,
    /// Per chunk: its fragment, or its raw copy.
    pub(crate) singles: Vec<(Option<Vec<u8>>, Option<Block>)>,
    /// The codec the job compresses with (the volume's, or the fast one: `defer`).
    pub(crate) codec: Compression,
}

/// Stage 2 for write-once journaling (state lock held): each WOJ candidate's journal block
/// must still hold content of the chunk's weak hash; its map entry must be data below the
/// reference cap and not damaged; a copy not on the device yet is compared here, from
/// memory. Candidates that fail are dropped (counted as collisions or stale in stage 4's
/// hold, see `woj`). No crc32c check comes first: the chunk's crc is not computed for a
/// candidate (`fingerprint`), and the byte comparison that must follow costs about as much.
pub(crate) fn resolve_woj(st: &mut State, woj: &Mutex<Woj>, buf: &[u8], plans: &mut [Plan]) -> (u64, u64) {
    let (mut collisions, mut stale) = (0u64, 0u64);
    let targets: Vec<Option<u64>> = {
        let w = woj.lock();
        plans
            .iter()
            .map(|p| match p {
                Plan::Data(DataPlan { woj: Some(c), weak, .. }) if w.still(c, *weak) => w.lba_of(c.j),
                _ => None,
            })
            .collect()
    };
    for ((i, p), target) in plans.iter_mut().enumerate().zip(targets) {
        let Plan::Data(d) = p else { continue };
        let Some(c) = d.woj.as_mut() else { continue };
        let Some(lba) = target else {
            stale += 1;
            d.woj = None;
            continue;
        };
        // A map page read error here only loses the candidate.
        let e = match st.map.get(lba) {
            Ok(e) if e.is_data() => e,
            _ => {
                stale += 1;
                d.woj = None;
                continue;
            }
        };
        if st.rc.min_of(&e) == 0 || st.rc.max_of(&e) >= st.rc.cap() || st.dedup.is_damaged(e.pbn) {
            stale += 1;
            d.woj = None;
            continue;
        }
        c.entry = Some(e);
        let mut out = [0u8; BLOCK_SIZE];
        match st.unwritten(&e, &mut out) {
            Some(true) if out == chunk(buf, i) => c.verified = true,
            Some(_) => {
                collisions += 1;
                d.woj = None;
            }
            None => {}
        }
    }
    (collisions, stale)
}
