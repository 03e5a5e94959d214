//! Stages 2 and 3: dedup candidates (under the state lock), then byte verification and
//! compression (no lock, in parallel).

use super::executor::{for_each, Executor};
use super::{chunk, Plan};
use crate::config::{Compression, BLOCK_SIZE};
use crate::data::packer;
use crate::data::placement::DataDevice;
use crate::dedup::{verify, Candidate};
use crate::metadata::block_map::MapEntry;
use crate::read::cache::{Block, ContentCache};
use crate::volume::state::State;
use parking_lot::Mutex;

/// Stage 2 (state lock held): each data chunk's dedup candidate. A candidate not on the
/// device yet (the device may still hold its block's previous life) is verified here,
/// from memory; the others are verified in stage 3.
pub(crate) fn find_candidates(st: &State, buf: &[u8], plans: &mut [Plan]) {
    for (i, p) in plans.iter_mut().enumerate() {
        let Plan::Data(d) = p else { continue };
        let cand = st.dedup.lookup(&d.hash, &st.rc);
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
    }
}

/// Stage 3 (no lock): reads and compares the candidates left unverified, and compresses
/// every chunk without a verified duplicate (keeping a raw copy when compression does not
/// pay).
pub(crate) fn verify_and_compress(
    exec: &dyn Executor,
    data: &DataDevice,
    cache: &Mutex<ContentCache>,
    compression: Compression,
    level: i8,
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
            d.frag = packer::compress(compression, level, c);
            if d.frag.is_none() {
                d.raw = Some(Block::from(c));
            }
        }
    });
}
