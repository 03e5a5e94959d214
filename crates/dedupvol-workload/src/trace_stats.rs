//! Reference-skew statistics of a block trace: how concentrated dedup references and
//! accesses are on a few contents.
//!
//! A *chunk* is one 4 KiB content (a content key, see [`crate::trace`]). Its *reference
//! count* is the number of distinct block addresses seen holding it during the trace — by a
//! write of it, or by a read that returned it (the real traces read addresses they never
//! write, and those reads show what the address holds). Its *accesses* are the block reads
//! and writes of it. The figures printed are the ones the SAR paper reports for the FIU
//! traces: the share of unique chunks referenced more than 10 times (≈ 6%), the share
//! referenced more than 5 times (≈ 4.5%) and the share of all accesses that go to those
//! (≈ 42%). Taken literally the first two cannot both hold (every chunk referenced more than
//! 10 times is also referenced more than 5 times); a trace matches both within a few points
//! when almost no chunk has 6 to 10 references, which is how [`crate::trace_gen`] builds
//! its traces. The share of chunks *accessed* more than 10 times is printed as well.
//!
//! Invariants:
//! - Memory is proportional to the distinct chunks plus the distinct (chunk, address)
//!   pairs: about 40 bytes per chunk and 16 per pair (hashed pairs; a 64-bit collision
//!   among millions of pairs is negligible for a percentage).
//! - Shares are fractions of counts taken over the same trace; an empty trace gives zeros,
//!   never NaN.

use crate::rng::mix64;
use crate::trace::{TraceOp, TraceRecord};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// Per-chunk counters.
#[derive(Debug, Default, Clone, Copy)]
struct ChunkCounts {
    refs: u32,
    accesses: u64,
}

/// Accumulates the statistics of a stream of records.
#[derive(Debug, Default)]
pub struct RefStatsBuilder {
    chunks: HashMap<u64, ChunkCounts>,
    pairs: HashSet<u64>,
    records: u64,
    reads: u64,
    writes: u64,
    block_accesses: u64,
    span_blocks: u64,
}

/// The figures of one trace.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RefStats {
    /// Records.
    pub records: u64,
    /// Read records.
    pub reads: u64,
    /// Write records.
    pub writes: u64,
    /// Block accesses (a record of N blocks is N accesses).
    pub block_accesses: u64,
    /// Distinct chunks.
    pub unique_chunks: u64,
    /// Share of unique chunks with more than 10 references (SAR: ≈ 0.06).
    pub chunks_refs_over_10: f64,
    /// Share of unique chunks with more than 5 references (SAR: ≈ 0.045).
    pub chunks_refs_over_5: f64,
    /// Share of block accesses that go to chunks with more than 5 references (SAR: ≈ 0.42).
    pub accesses_to_refs_over_5: f64,
    /// Share of unique chunks accessed more than 10 times.
    pub chunks_accessed_over_10: f64,
    /// Highest reference count.
    pub refs_max: u32,
    /// Blocks from address 0 to the highest block touched (a replay target needs this many).
    pub span_blocks: u64,
}

impl RefStatsBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one record.
    pub fn add(&mut self, r: &TraceRecord) {
        self.records += 1;
        match r.op {
            TraceOp::Read => self.reads += 1,
            TraceOp::Write => self.writes += 1,
        }
        self.span_blocks = self.span_blocks.max(r.first_block() + r.block_count());
        for k in 0..r.block_count() {
            let key = r.content_key(k);
            let addr = r.first_block() + k;
            self.block_accesses += 1;
            let c = self.chunks.entry(key).or_default();
            c.accesses += 1;
            if self.pairs.insert(mix64(key, addr)) {
                c.refs = c.refs.saturating_add(1);
            }
        }
    }

    /// The statistics so far.
    pub fn finish(&self) -> RefStats {
        let n = self.chunks.len() as u64;
        let share = |count: u64, of: u64| if of == 0 { 0.0 } else { count as f64 / of as f64 };
        let mut over10 = 0;
        let mut over5 = 0;
        let mut acc_over5 = 0;
        let mut accessed10 = 0;
        let mut refs_max = 0;
        for c in self.chunks.values() {
            refs_max = refs_max.max(c.refs);
            if c.refs > 10 {
                over10 += 1;
            }
            if c.refs > 5 {
                over5 += 1;
                acc_over5 += c.accesses;
            }
            if c.accesses > 10 {
                accessed10 += 1;
            }
        }
        RefStats {
            records: self.records,
            reads: self.reads,
            writes: self.writes,
            block_accesses: self.block_accesses,
            unique_chunks: n,
            chunks_refs_over_10: share(over10, n),
            chunks_refs_over_5: share(over5, n),
            accesses_to_refs_over_5: share(acc_over5, self.block_accesses),
            chunks_accessed_over_10: share(accessed10, n),
            refs_max,
            span_blocks: self.span_blocks,
        }
    }
}

impl RefStats {
    /// The figures as printable lines, each beside the SAR paper's value for the FIU traces.
    pub fn render(&self) -> String {
        let mut t = crate::table::Table::new(&["statistic", "this trace", "FIU (SAR paper)"]);
        let pct = |v: f64| format!("{:.1}%", v * 100.0);
        t.row(vec![
            "records (reads / writes)".into(),
            format!("{} ({} / {})", self.records, self.reads, self.writes),
            "-".into(),
        ]);
        t.row(vec!["4 KiB block accesses".into(), self.block_accesses.to_string(), "-".into()]);
        t.row(vec!["unique chunks".into(), self.unique_chunks.to_string(), "-".into()]);
        t.row(vec!["unique chunks with refs > 10".into(), pct(self.chunks_refs_over_10), "6%".into()]);
        t.row(vec!["unique chunks with refs > 5".into(), pct(self.chunks_refs_over_5), "4.5%".into()]);
        t.row(vec!["accesses to chunks with refs > 5".into(), pct(self.accesses_to_refs_over_5), "42%".into()]);
        t.row(vec!["unique chunks accessed > 10 times".into(), pct(self.chunks_accessed_over_10), "-".into()]);
        t.row(vec!["highest reference count".into(), self.refs_max.to_string(), "-".into()]);
        t.row(vec![
            "address span (4 KiB blocks)".into(),
            format!("{} ({} MiB)", self.span_blocks, (self.span_blocks * 4096) >> 20),
            "-".into(),
        ]);
        t.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::parse_line;

    #[test]
    fn counts_distinct_addresses_and_accesses() {
        let a = "11111111111111111111111111111111";
        let b = "22222222222222222222222222222222";
        let mut lines = Vec::new();
        // Chunk a at 12 addresses, read 3 more times; chunk b written twice at one address.
        for i in 0..12 {
            lines.push(format!("{i} 1 p {} 8 W 8 0 {a}", i * 8));
        }
        for _ in 0..3 {
            lines.push(format!("20 1 p 0 8 R 8 0 {a}"));
        }
        lines.push(format!("30 1 p 800 8 W 8 0 {b}"));
        lines.push(format!("31 1 p 800 8 W 8 0 {b}"));
        let mut s = RefStatsBuilder::new();
        for (n, l) in lines.iter().enumerate() {
            s.add(&parse_line(l, n as u64 + 1).expect("line"));
        }
        let st = s.finish();
        assert_eq!(st.unique_chunks, 2);
        assert_eq!(st.refs_max, 12);
        assert_eq!(st.span_blocks, 101);
        assert_eq!(st.chunks_refs_over_10, 0.5);
        assert_eq!(st.chunks_refs_over_5, 0.5);
        assert_eq!(st.block_accesses, 17);
        assert!((st.accesses_to_refs_over_5 - 15.0 / 17.0).abs() < 1e-12);
        assert_eq!(RefStatsBuilder::new().finish().accesses_to_refs_over_5, 0.0);
    }
}
