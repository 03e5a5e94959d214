//! Stages 2 and 3: dedup candidates (under the state lock), then byte verification and
//! compression (no lock, in parallel).

use super::executor::{for_each, Executor};
use super::{chunk, Plan};
use crate::config::{Compression, BLOCK_SIZE};
use crate::data::packer;
use crate::data::placement::DataDevice;
use crate::dedup::index::{Fetch, PageSource};
use crate::dedup::{verify, Candidate};
use crate::metadata::block_map::MapEntry;
use crate::read::cache::{Block, ContentCache};
use crate::volume::state::State;
use parking_lot::Mutex;

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
                let e = MapEntry { pbn: loc.pbn, state: loc.state, crc: 0 };
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
    (fetches, again)
}

/// Record pages one batch reads for its lookups at most (a batch is at most 1,024 chunks;
/// past this bound the chunks just miss their duplicates).
const FETCHES_MAX: usize = 256;

/// Reads the record pages stage 2 asked for (no lock; in parallel for several).
pub(crate) fn read_pages(exec: &dyn Executor, source: &PageSource, fetches: &mut [Fetch]) {
    for_each(exec, fetches, |_, f| source.fetch(f));
}

/// Stage 3 (no lock): reads and compares the candidates left unverified, and compresses
/// every chunk without a verified duplicate (keeping a raw copy when compression does not
/// pay).
pub(crate) fn verify_and_compress(
    exec: &dyn Executor,
    data: &DataDevice,
    cache: &Mutex<ContentCache>,
    compression: Compression,
    buf: &[u8],
    plans: &mut [Plan],
) {
    for_each(exec, plans, |i, p| {
        let Plan::Data(d) = p else { return };
        let c = chunk(buf, i);
        if let Candidate { loc: Some(loc), verified: false } = d.cand {
            d.cand.verified = verify::by_read(data, cache, loc, c);
        }
        if !d.cand.verified {
            d.frag = packer::compress(compression, c);
            if d.frag.is_none() {
                d.raw = Some(Block::from(c));
            }
        }
    });
}
