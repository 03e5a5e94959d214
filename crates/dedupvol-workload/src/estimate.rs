//! Reduction estimate: what the engine would save on some files or devices, without
//! writing anything (what `zdb -S` or a dedup estimator gives users before they migrate).
//!
//! Every chunk is classified exactly as the engine's write path would:
//! 1. all zeros → a zero chunk (no space, no I/O);
//! 2. else its BLAKE3 fingerprint (first 16 bytes, in a `HashSet`) was seen before → a
//!    duplicate;
//! 3. else unique: compressed with the volume's codec and level (default zstd at level 1)
//!    as the engine's write path does (`units`): runs of consecutive unique chunks inside
//!    one 128 KiB window of the data (the engine forms them per write request; requests of
//!    128 KiB or more give about the same units) that pass the engine's
//!    incompressibility probe are compressed as extents of up to 16 chunks
//!    (`dedupvol_core::extent_size`; raw when the unit does not save 1/16); every other
//!    chunk alone (`fragment_size`, probe
//!    included), stored raw when that does not save at least 1/16.
//!
//! Fragments are packed back to back, byte for byte, into runs of at most 32 blocks, as
//! the engine's are: the physical bytes are the raw chunks plus the blocks the runs fill.
//! The engine also closes a run at each group commit and when the block after it is
//! taken, which depends on timing, so the estimate can be slightly optimistic for
//! workloads with frequent flushes.
//!
//! Chunks larger than 4 KiB model a hypothetical engine with bigger chunks, each
//! compressed alone and packed the same way.
//!
//! With `policies` on (4 KiB chunks only), the scan also prices the unique chunks under
//! other ways of storing compressed data ([`POLICY_EXTENT_BYTES`]): each 4 KiB fragment
//! rounded up to 512-byte sectors, or byte for byte; and runs of consecutive unique chunks
//! (in scan order, up to an extent's size, within one 8 MiB batch; duplicates and zeros in
//! between are skipped, as a write of them would share them) compressed as one unit and
//! rounded to sectors, at most their raw size. Dedup stays at 4 KiB in every policy. For
//! zstd it also prices data at rest as this engine stores it, byte for byte at the
//! default rest level ([`POLICY_REST_LEVEL`]): 64 KiB extents, and 16 KiB extents
//! compressed with a dictionary trained from the first batch's unique data (as a volume
//! trains one from the first data it settles; the default extent size of a volume with a
//! rest level).
//!
//! Invariants:
//! - Exact fingerprinting: a 128-bit BLAKE3 prefix per unique chunk, no sampling.
//! - `zero + dedup + compression savings + physical` accounts for every scanned byte, and
//!   `gross compression - packing overhead` is the net compression saving (checked by
//!   [`EstimateReport::check_balance`]).
//! - Files shorter than a whole chunk are padded with zeros, as the engine's
//!   read-modify-write of a partial last block leaves them.

use serde::Serialize;
use std::collections::HashSet;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Read;
use std::path::Path;
use std::time::Instant;

/// Physical block size of the engine, in bytes.
pub const PHYSICAL_BLOCK_BYTES: u64 = 4096;
/// Largest compressed chunk of 4 KiB the engine stores compressed (it must save 1/16).
pub const FRAGMENT_BYTES_MAX: u64 = PHYSICAL_BLOCK_BYTES - PHYSICAL_BLOCK_BYTES / 16;
/// Smallest and largest chunk sizes accepted, in bytes.
pub const CHUNK_BYTES_MIN: usize = 4096;
/// See [`CHUNK_BYTES_MIN`].
pub const CHUNK_BYTES_MAX: usize = 32768;
/// Bytes read and processed per batch.
const BATCH_BYTES: usize = 8 << 20;
/// Sector of the sector-granular policies, in bytes.
pub const POLICY_SECTOR_BYTES: u64 = 512;
/// Extent sizes the policy table prices, in bytes.
pub const POLICY_EXTENT_BYTES: [usize; 3] = [16 << 10, 64 << 10, 128 << 10];

/// zstd level the at-rest policies compress with (the engine's default rest level).
pub const POLICY_REST_LEVEL: i8 = 6;

/// Physical bytes of the unique data under one storage policy (`EstimateOptions::policies`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PolicyFigure {
    /// What the policy stores: unit and rounding.
    pub policy: String,
    /// Physical data bytes it would use.
    pub physical_bytes: u64,
    /// (scanned - zero) / physical.
    pub reduction_ratio: f64,
}

/// Estimate settings.
#[derive(Debug, Clone, Serialize)]
pub struct EstimateOptions {
    /// Chunk (dedup unit) size in bytes: 4, 8, 16 or 32 KiB.
    pub chunk_bytes: usize,
    /// Hashing/compression threads.
    pub threads: usize,
    /// Codec the modelled volume compresses with.
    pub compression: dedupvol_core::Compression,
    /// Its level (zstd; 0 for the default).
    pub compression_level: i8,
    /// Also price other storage policies (4 KiB chunks only; several more compression
    /// passes over the unique data).
    pub policies: bool,
}

impl Default for EstimateOptions {
    fn default() -> Self {
        EstimateOptions {
            chunk_bytes: 4096,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            compression: dedupvol_core::Compression::Zstd,
            compression_level: 0,
            policies: false,
        }
    }
}

/// What the scan found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EstimateReport {
    /// Chunk size used, in bytes.
    pub chunk_bytes: u64,
    /// Codec modelled.
    pub compression: dedupvol_core::Compression,
    /// Its level (zstd: the level in effect; 0 for the other codecs).
    pub compression_level: i8,
    /// Other storage policies priced (empty unless `EstimateOptions::policies`).
    pub policies: Vec<PolicyFigure>,
    /// Paths scanned.
    pub paths: Vec<String>,
    /// Bytes read (files padded to whole chunks).
    pub scanned_bytes: u64,
    /// Chunks scanned.
    pub chunks: u64,
    /// All-zero chunks.
    pub zero_chunks: u64,
    /// Chunks whose fingerprint was seen before.
    pub dup_chunks: u64,
    /// First occurrences.
    pub unique_chunks: u64,
    /// Unique chunks stored compressed.
    pub compressed_chunks: u64,
    /// Unique chunks stored raw (compression saves too little).
    pub raw_chunks: u64,
    /// Sum of the compressed sizes of the compressed chunks, in bytes.
    pub compressed_payload_bytes: u64,
    /// 4 KiB blocks the fragments fill, packed back to back.
    pub packed_blocks: u64,
    /// Physical data bytes the engine would use (raw + packed blocks).
    pub physical_bytes: u64,
    /// Logical bytes that are zero chunks.
    pub savings_zero_bytes: u64,
    /// Logical bytes stored as references.
    pub savings_dedup_bytes: u64,
    /// Bytes compression saves net of packing: unique chunk bytes minus the physical bytes
    /// they take (the engine's `savings.compression_bytes` definition).
    pub savings_compression_bytes: u64,
    /// Bytes compression saves before packing (chunk size minus compressed size, summed).
    pub compression_gross_bytes: u64,
    /// Unused bytes of the blocks the fragments fill (the last one's free tail).
    pub packing_overhead_bytes: u64,
    /// (scanned - zero) / physical: comparable to the engine's `reduction_ratio`.
    pub reduction_ratio: f64,
    /// scanned / physical (zeros included).
    pub total_reduction_ratio: f64,
    /// Memory of the fingerprint set, in bytes (16 per unique chunk plus table overhead).
    pub fingerprint_set_bytes: u64,
    /// Wall time of the scan, in seconds.
    pub seconds: f64,
    /// scanned bytes / seconds, in MB/s (10^6 bytes).
    pub mb_per_s: f64,
}

impl EstimateReport {
    /// Checks that every scanned byte is accounted for.
    pub fn check_balance(&self) -> Result<(), String> {
        let accounted =
            self.savings_zero_bytes + self.savings_dedup_bytes + self.savings_compression_bytes + self.physical_bytes;
        if accounted != self.scanned_bytes {
            return Err(format!("estimate accounts for {accounted} bytes of {} scanned", self.scanned_bytes));
        }
        if self.compression_gross_bytes != self.savings_compression_bytes + self.packing_overhead_bytes {
            return Err(format!(
                "gross compression {} != net {} + packing overhead {}",
                self.compression_gross_bytes, self.savings_compression_bytes, self.packing_overhead_bytes
            ));
        }
        Ok(())
    }
}

/// A hasher for keys that are already uniformly random (fingerprint prefixes).
#[derive(Default)]
struct PrefixHasher(u64);
impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

/// The streaming scanner; feed it data with [`Estimator::feed`], one file at a time.
pub struct Estimator {
    opts: EstimateOptions,
    seen: HashSet<u128, BuildHasherDefault<PrefixHasher>>,
    report: EstimateReport,
    /// Bytes of raw chunks stored.
    raw_bytes: u64,
    /// Blocks of the runs closed so far, and the bytes of the open one (the engine's runs
    /// hold at most `RUN_BLOCKS_MAX` blocks; a fragment that does not fit closes one).
    closed_blocks: u64,
    run_bytes: u64,
    /// Physical bytes per policy, in the order of `policy_names`.
    policy_bytes: Vec<u64>,
    /// The dictionary the at-rest policy uses, trained from the first batch (None: not
    /// yet, or the trainer kept nothing: units are then priced without one).
    dictionary: Option<dedupvol_core::TrainedDictionary>,
    /// The first batch has been seen (the dictionary is trained once).
    dictionary_tried: bool,
    started: Instant,
}

/// The policies priced, in order: 4 KiB sectors, 4 KiB bytes, each extent size, then (zstd
/// only) the two at rest.
fn policy_names(zstd: bool) -> Vec<String> {
    let mut v = vec!["4K fragments in 512-B sectors".to_string(), "4K fragments, byte-granular".to_string()];
    v.extend(POLICY_EXTENT_BYTES.iter().map(|e| format!("{}K extents in 512-B sectors", e >> 10)));
    if zstd {
        v.push(format!("at rest (zstd:{POLICY_REST_LEVEL}), 64K extents, byte-granular"));
        v.push(format!("at rest (zstd:{POLICY_REST_LEVEL}), 16K extents + dictionary (default)"));
    }
    v
}

impl Estimator {
    /// A new scanner; fails on an unsupported chunk size.
    pub fn new(opts: EstimateOptions) -> Result<Self, String> {
        let c = opts.chunk_bytes;
        if !(CHUNK_BYTES_MIN..=CHUNK_BYTES_MAX).contains(&c) || !c.is_power_of_two() {
            return Err(format!("chunk size {c} must be 4K, 8K, 16K or 32K"));
        }
        if opts.policies && c != PHYSICAL_BLOCK_BYTES as usize {
            return Err(format!("the policy table needs 4K chunks, not {c}"));
        }
        let report = EstimateReport {
            chunk_bytes: c as u64,
            compression: opts.compression,
            compression_level: dedupvol_core::effective_level(opts.compression, opts.compression_level),
            ..Default::default()
        };
        Ok(Estimator {
            policy_bytes: if opts.policies {
                vec![0; policy_names(opts.compression == dedupvol_core::Compression::Zstd).len()]
            } else {
                Vec::new()
            },
            dictionary: None,
            dictionary_tried: false,
            opts,
            seen: HashSet::default(),
            report,
            raw_bytes: 0,
            closed_blocks: 0,
            run_bytes: 0,
            started: Instant::now(),
        })
    }

    /// Scans a file or block device, padding its tail to a whole chunk.
    pub fn scan_path(&mut self, path: &Path) -> Result<(), String> {
        let mut f = File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
        self.report.paths.push(path.display().to_string());
        let mut buf = vec![0u8; BATCH_BYTES];
        loop {
            let mut filled = 0;
            while filled < buf.len() {
                let n = f.read(&mut buf[filled..]).map_err(|e| format!("reading {}: {e}", path.display()))?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            if filled == 0 {
                break;
            }
            let padded = filled.div_ceil(self.opts.chunk_bytes) * self.opts.chunk_bytes;
            buf[filled..padded].fill(0);
            self.feed(&buf[..padded]);
            if filled < buf.len() {
                break;
            }
        }
        Ok(())
    }

    /// Scans `data`, a whole number of chunks (a shorter tail is padded with zeros).
    pub fn feed(&mut self, data: &[u8]) {
        let c = self.opts.chunk_bytes;
        if !data.len().is_multiple_of(c) {
            let mut padded = data.to_vec();
            padded.resize(data.len().div_ceil(c) * c, 0);
            return self.feed(&padded);
        }
        let chunks: Vec<&[u8]> = data.chunks_exact(c).collect();
        // Phase 1 (parallel): zero check and fingerprint.
        let fps: Vec<Option<u128>> = par_map(&chunks, self.opts.threads, |ch| {
            if ch.iter().all(|&b| b == 0) {
                None
            } else {
                let h = blake3::hash(ch);
                let mut p = [0u8; 16];
                p.copy_from_slice(&h.as_bytes()[..16]);
                Some(u128::from_le_bytes(p))
            }
        });
        // Phase 2 (in order, so "first occurrence" is well defined): dedup.
        let mut new_chunks = Vec::new();
        let mut new_at: Vec<u64> = Vec::new();
        for (ch, fp) in chunks.iter().zip(&fps) {
            let at = self.report.chunks;
            self.report.chunks += 1;
            self.report.scanned_bytes += c as u64;
            match fp {
                None => {
                    self.report.zero_chunks += 1;
                    self.report.savings_zero_bytes += c as u64;
                }
                Some(fp) if !self.seen.insert(*fp) => {
                    self.report.dup_chunks += 1;
                    self.report.savings_dedup_bytes += c as u64;
                }
                Some(_) => {
                    new_chunks.push(*ch);
                    new_at.push(at);
                }
            }
        }
        // Phase 3 (parallel): the engine's units (see `units`), compressed; then stored in
        // order, back to back.
        let (codec, level) = (self.opts.compression, self.opts.compression_level);
        let probe = par_map(&new_chunks, self.opts.threads, |ch| {
            c == PHYSICAL_BLOCK_BYTES as usize && !dedupvol_core::incompressible(codec, ch)
        });
        let units = units(&new_at, &probe);
        let stored: Vec<Vec<Option<u64>>> = par_map(&units, self.opts.threads, |&(first, n)| {
            let members = new_chunks.get(first..first + n).unwrap_or_default();
            if n >= 2 {
                // An extent that does not save 1/16 is stored raw, as the engine does.
                return match dedupvol_core::extent_size(codec, level, &members.concat()) {
                    Some(len) => vec![Some(len as u64)],
                    None => vec![None; n],
                };
            }
            members
                .iter()
                .map(|ch| {
                    let s = compressed_size(codec, level, ch);
                    // Stored compressed only when that saves 1/16 of the chunk.
                    (s <= ch.len() as u64 - ch.len() as u64 / 16).then_some(s)
                })
                .collect()
        });
        for ((first, n), sizes) in units.iter().zip(&stored) {
            match sizes.as_slice() {
                [Some(len)] if *n >= 2 => self.store_fragment(*n as u64, *len),
                _ => {
                    for s in sizes {
                        match s {
                            Some(len) => self.store_fragment(1, *len),
                            None => self.store_raw(),
                        }
                    }
                }
            }
            let _ = first;
        }
        if self.opts.policies {
            let sizes: Vec<u64> = par_map(&new_chunks, self.opts.threads, |ch| compressed_size(codec, level, ch));
            self.price_policies(&new_chunks, &sizes);
        }
    }

    /// Adds the unique chunks of one batch (in scan order, with their 4 KiB compressed
    /// sizes) to every policy's physical bytes.
    fn price_policies(&mut self, unique: &[&[u8]], sizes: &[u64]) {
        let sector = |n: u64| n.div_ceil(POLICY_SECTOR_BYTES) * POLICY_SECTOR_BYTES;
        let mut totals = vec![sizes.iter().map(|&s| sector(s)).sum::<u64>(), sizes.iter().sum::<u64>()];
        let (codec, level) = (self.opts.compression, self.opts.compression_level);
        for extent in POLICY_EXTENT_BYTES {
            let runs: Vec<&[&[u8]]> = unique.chunks(extent / PHYSICAL_BLOCK_BYTES as usize).collect();
            let stored = par_map(&runs, self.opts.threads, |run| {
                let unit: Vec<u8> = run.concat();
                sector(compressed_size(codec, level, &unit)).min(unit.len() as u64)
            });
            totals.push(stored.iter().sum());
        }
        if codec == dedupvol_core::Compression::Zstd {
            let raw = |unit: &[u8], n: Option<usize>| n.map_or(unit.len() as u64, |n| n as u64);
            let runs: Vec<Vec<u8>> = unique.chunks(16).map(|r| r.concat()).collect();
            let at_rest = par_map(&runs, self.opts.threads, |u| {
                raw(
                    u,
                    dedupvol_core::extent_size(codec, POLICY_REST_LEVEL, u)
                        .or_else(|| dedupvol_core::fragment_size(codec, POLICY_REST_LEVEL, u)),
                )
            });
            totals.push(at_rest.iter().sum());
            if !self.dictionary_tried {
                self.dictionary_tried = true;
                let samples: Vec<&[u8]> = runs.iter().flat_map(|u| u.chunks(16 << 10)).collect();
                self.dictionary = dedupvol_core::TrainedDictionary::train(&samples);
            }
            let small: Vec<Vec<u8>> = unique.chunks(4).map(|r| r.concat()).collect();
            let dict = self.dictionary.as_ref();
            let with_dict = par_map(&small, self.opts.threads, |u| {
                raw(
                    u,
                    match dict {
                        Some(d) => d.fragment_size(POLICY_REST_LEVEL, u),
                        None if u.len() == PHYSICAL_BLOCK_BYTES as usize => {
                            dedupvol_core::fragment_size(codec, POLICY_REST_LEVEL, u)
                        }
                        None => dedupvol_core::extent_size(codec, POLICY_REST_LEVEL, u),
                    },
                )
            });
            totals.push(with_dict.iter().sum());
        }
        for (t, add) in self.policy_bytes.iter_mut().zip(totals) {
            *t += add;
        }
    }

    /// A unique chunk stored raw.
    fn store_raw(&mut self) {
        let c = self.opts.chunk_bytes as u64;
        let r = &mut self.report;
        r.unique_chunks += 1;
        r.raw_chunks += 1;
        self.raw_bytes += c;
        self.update_physical();
    }

    /// `n` unique chunks stored as one fragment of `len` bytes, packed byte for byte.
    fn store_fragment(&mut self, n: u64, len: u64) {
        let c = self.opts.chunk_bytes as u64;
        let r = &mut self.report;
        r.unique_chunks += n;
        r.compressed_chunks += n;
        r.compressed_payload_bytes += len;
        r.compression_gross_bytes += n * c - len;
        if self.run_bytes + len > dedupvol_core::format::RUN_BLOCKS_MAX * PHYSICAL_BLOCK_BYTES {
            self.closed_blocks += self.run_bytes.div_ceil(PHYSICAL_BLOCK_BYTES);
            self.run_bytes = 0;
        }
        self.run_bytes += len;
        self.update_physical();
    }

    /// Physical bytes: raw chunks, and the blocks the fragments fill back to back.
    fn update_physical(&mut self) {
        let r = &mut self.report;
        r.packed_blocks = self.closed_blocks + self.run_bytes.div_ceil(PHYSICAL_BLOCK_BYTES);
        r.physical_bytes = self.raw_bytes + r.packed_blocks * PHYSICAL_BLOCK_BYTES;
        r.packing_overhead_bytes = r.packed_blocks * PHYSICAL_BLOCK_BYTES - r.compressed_payload_bytes;
    }

    /// The figures so far (ratios are filled in by [`Estimator::finish`]).
    pub fn report(&self) -> &EstimateReport {
        &self.report
    }

    /// Finishes the scan.
    pub fn finish(mut self) -> EstimateReport {
        let r = &mut self.report;
        r.savings_compression_bytes = (r.unique_chunks * r.chunk_bytes).saturating_sub(r.physical_bytes);
        let logical = r.scanned_bytes - r.savings_zero_bytes;
        r.policies = policy_names(self.opts.compression == dedupvol_core::Compression::Zstd)
            .into_iter()
            .zip(&self.policy_bytes)
            .map(|(policy, &physical_bytes)| PolicyFigure {
                policy,
                physical_bytes,
                reduction_ratio: if physical_bytes > 0 { logical as f64 / physical_bytes as f64 } else { 0.0 },
            })
            .collect();
        r.reduction_ratio = if r.physical_bytes > 0 { logical as f64 / r.physical_bytes as f64 } else { 0.0 };
        r.total_reduction_ratio =
            if r.physical_bytes > 0 { r.scanned_bytes as f64 / r.physical_bytes as f64 } else { 0.0 };
        // hashbrown stores one 16-byte key plus one control byte per bucket.
        r.fingerprint_set_bytes = self.seen.capacity() as u64 * 17;
        r.seconds = self.started.elapsed().as_secs_f64();
        r.mb_per_s = if r.seconds > 0.0 { r.scanned_bytes as f64 / r.seconds / 1e6 } else { 0.0 };
        self.report
    }
}

/// The compressed size of `chunk` (its own size when the codec stores it raw): 4 KiB chunks
/// exactly as the engine decides, larger ones with the codec's whole-chunk output.
fn compressed_size(codec: dedupvol_core::Compression, level: i8, chunk: &[u8]) -> u64 {
    use dedupvol_core::Compression;
    let raw = chunk.len() as u64;
    if chunk.len() == PHYSICAL_BLOCK_BYTES as usize {
        return dedupvol_core::fragment_size(codec, level, chunk).map_or(raw, |n| n as u64);
    }
    let n = match codec {
        Compression::None => return raw,
        Compression::Lz4 => lz4_flex::block::compress(chunk).len(),
        Compression::Zstd => {
            let level = i32::from(dedupvol_core::effective_level(codec, level));
            zstd::bulk::compress(chunk, level).map_or(chunk.len(), |v| v.len())
        }
    };
    (n as u64).min(raw)
}

/// The engine's compression units over a batch's unique chunks (`at`: each one's position
/// in the stream; `probe`: it may join an extent): runs of consecutive chunks inside one
/// 128 KiB request (the engine forms extents per write request; an import writes 128 KiB
/// ones), cut into near-equal units of at most `UNIT_BLOCKS_MAX`; every other chunk a
/// unit of its own. Returns (first index, chunks) per unit, in order.
fn units(at: &[u64], probe: &[bool]) -> Vec<(usize, usize)> {
    const REQUEST_CHUNKS: u64 = (128 << 10) / PHYSICAL_BLOCK_BYTES;
    let max = usize::from(dedupvol_core::format::UNIT_BLOCKS_MAX);
    let mut out = Vec::new();
    let mut i = 0;
    while i < at.len() {
        let joins = |k: usize| probe.get(k).copied().unwrap_or(false);
        let mut run = 1;
        if joins(i) {
            while i + run < at.len()
                && joins(i + run)
                && at.get(i + run).copied() == at.get(i + run - 1).map(|p| p + 1)
                && at.get(i + run).map(|p| p / REQUEST_CHUNKS) == at.get(i).map(|p| p / REQUEST_CHUNKS)
            {
                run += 1;
            }
        }
        let pieces = run.div_ceil(max);
        let size = run.div_ceil(pieces);
        let mut k = i;
        while k < i + run {
            let n = size.min(i + run - k);
            out.push((k, n));
            k += n;
        }
        i += run;
    }
    out
}

/// Maps `f` over `items` on up to `threads` scoped threads, keeping the order.
pub fn par_map<T: Sync, R: Send + Default + Clone>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.max(1).min(items.len().max(1));
    if threads == 1 {
        return items.iter().map(&f).collect();
    }
    let mut out = vec![R::default(); items.len()];
    let per = items.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (ins, outs) in items.chunks(per).zip(out.chunks_mut(per)) {
            let f = &f;
            s.spawn(move || {
                for (i, o) in ins.iter().zip(outs.iter_mut()) {
                    *o = f(i);
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::{ContentModel, DataSpec};

    fn generated(dup: f64, comp: f64, blocks: usize) -> Vec<u8> {
        let m = ContentModel::new(DataSpec::new(dup, comp, 42)).expect("model");
        let mut v = vec![0u8; blocks * 4096];
        m.fill_range(0, &mut v);
        v
    }

    #[test]
    fn classifies_zero_dup_and_compressible_chunks() {
        // LZ4, the codec the generator's compressibility is defined by.
        let opts = EstimateOptions {
            chunk_bytes: 4096,
            threads: 2,
            compression: dedupvol_core::Compression::Lz4,
            ..EstimateOptions::default()
        };
        let mut e = Estimator::new(opts).expect("estimator");
        let data = generated(0.75, 0.5, 4000);
        e.feed(&data);
        e.feed(&vec![0u8; 40960]);
        let r = e.finish();
        r.check_balance().expect("balance");
        assert_eq!(r.zero_chunks, 10);
        let dup = r.dup_chunks as f64 / 4000.0;
        assert!((dup - 0.75).abs() < 0.03, "dup {dup}");
        assert_eq!(r.raw_chunks, 0);
        // 50% compressible: fragments of about half a block, packed back to back, so
        // about two unique chunks per block on top of the 4x of dedup.
        let ratio = r.reduction_ratio;
        assert!(ratio > 7.0 && ratio < 9.0, "ratio {ratio}");
        assert!((r.packed_blocks as f64) < 0.6 * r.unique_chunks as f64);
    }

    #[test]
    fn incompressible_unique_data_is_stored_raw() {
        let mut e = Estimator::new(EstimateOptions { chunk_bytes: 4096, threads: 1, ..EstimateOptions::default() })
            .expect("estimator");
        e.feed(&generated(0.0, 0.0, 500));
        let r = e.finish();
        r.check_balance().expect("balance");
        assert_eq!(r.raw_chunks, 500);
        assert_eq!(r.physical_bytes, 500 * 4096);
        assert_eq!(r.packed_blocks, 0);
    }

    #[test]
    fn fragments_pack_back_to_back() {
        let mut e = Estimator::new(EstimateOptions { chunk_bytes: 4096, threads: 1, ..EstimateOptions::default() })
            .expect("estimator");
        for size in [3000, 3000, 1000, 1000] {
            e.store_fragment(1, size);
        }
        // 8000 bytes fill two blocks, the second with 192 bytes to spare.
        assert_eq!(e.report().packed_blocks, 2);
        assert_eq!(e.report().packing_overhead_bytes, 192);
        e.store_fragment(16, 20_000);
        e.store_raw();
        // The chunks the calls above stand for, as a scan would have counted them.
        e.report.chunks = 21;
        e.report.scanned_bytes = 21 * 4096;
        let r = e.finish();
        r.check_balance().expect("balance");
        assert_eq!(r.packed_blocks, 28_000u64.div_ceil(4096));
        assert_eq!((r.unique_chunks, r.compressed_chunks, r.raw_chunks), (21, 20, 1));
    }

    #[test]
    fn units_follow_requests_and_split_evenly() {
        // 20 consecutive chunks in one request: two units of 10. A chunk that fails the
        // probe, a gap, and a request boundary each end a run.
        let at: Vec<u64> = (0..20).chain([20, 21, 23, 31, 32]).collect();
        let mut probe = vec![true; at.len()];
        probe[20] = false;
        assert_eq!(units(&at, &probe), vec![(0, 10), (10, 10), (20, 1), (21, 1), (22, 1), (23, 1), (24, 1)]);
        let at: Vec<u64> = (32..64).collect();
        assert_eq!(units(&at, &[true; 32]), vec![(0, 16), (16, 16)]);
    }

    #[test]
    fn larger_chunks_and_bad_sizes() {
        let data = generated(0.5, 0.35, 2048);
        let mut e = Estimator::new(EstimateOptions { chunk_bytes: 32768, threads: 2, ..EstimateOptions::default() })
            .expect("estimator");
        e.feed(&data);
        let r = e.finish();
        r.check_balance().expect("balance");
        assert_eq!(r.chunks, 256);
        assert!(
            Estimator::new(EstimateOptions { chunk_bytes: 12288, threads: 1, ..EstimateOptions::default() }).is_err()
        );
        assert!(
            Estimator::new(EstimateOptions { chunk_bytes: 65536, threads: 1, ..EstimateOptions::default() }).is_err()
        );
    }

    #[test]
    fn scan_path_pads_the_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("f");
        let mut data = generated(0.0, 0.5, 3);
        data.truncate(3 * 4096 - 100);
        std::fs::write(&p, &data).expect("write");
        let mut e = Estimator::new(EstimateOptions::default()).expect("estimator");
        e.scan_path(&p).expect("scan");
        let r = e.finish();
        assert_eq!(r.scanned_bytes, 3 * 4096);
        assert_eq!(r.unique_chunks, 3);
        assert!(Estimator::new(EstimateOptions::default()).expect("e").scan_path(Path::new("/nonexistent/x")).is_err());
    }

    /// The policy table prices the same unique data several ways: byte-granular is never
    /// above sector-rounded, larger extents compress repetitive data better, and a
    /// random batch costs at most its raw size under every policy.
    #[test]
    fn the_policy_table_orders_the_policies() {
        let opts = EstimateOptions { chunk_bytes: 4096, threads: 2, policies: true, ..EstimateOptions::default() };
        let mut e = Estimator::new(opts.clone()).expect("estimator");
        e.feed(&generated(0.5, 0.6, 3000));
        let r = e.finish();
        assert_eq!(opts.compression, dedupvol_core::Compression::Zstd);
        assert_eq!(r.policies.len(), 2 + POLICY_EXTENT_BYTES.len() + 2, "zstd adds the two at rest");
        let b: Vec<u64> = r.policies.iter().map(|p| p.physical_bytes).collect();
        assert!(b[1] <= b[0], "{:?}", r.policies);
        assert!(b[0] <= r.physical_bytes + r.unique_chunks * POLICY_SECTOR_BYTES, "{:?}", r.policies);
        let mut e = Estimator::new(opts).expect("estimator");
        let random: Vec<u8> = (0..64 * 4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        e.feed(&random);
        let r = e.finish();
        for p in &r.policies {
            assert!(p.physical_bytes <= r.unique_chunks * 4096, "{p:?}");
        }
        assert!(Estimator::new(EstimateOptions { chunk_bytes: 8192, policies: true, ..EstimateOptions::default() })
            .is_err());
    }
}
