//! The offload interface: the fingerprint and compression stages run on the backend the
//! volume was given, and a backend that answers wrongly or fails costs time or dedup,
//! never data: reads return what was written, the audit is clean, and a reopen with the
//! built-in CPU backend reads the same.
mod common;
use common::*;
use dedupvol_core::{
    compress_unit, print_chunk, Capacity, CompressUnit, Compressed, CpuOffload, Offload, OffloadError, OpenOptions,
    PrintOp, Prints, Storage, Volume,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How a test backend answers.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Exactly as the CPU does.
    None,
    /// Every fragment with its last byte flipped, every other one too long as well.
    CorruptFragments,
    /// The same BLAKE3 for every chunk: with stamps trusted, every chunk would share the
    /// newest one's content.
    ConstantFingerprint,
    /// Every other chunk called zero, the others' crc32c off by one.
    FalseZeroAndCrc,
    /// Every call fails.
    Fails,
}

/// A backend over `CpuOffload` that counts its calls and answers as `fault` says.
struct TestBackend {
    cpu: CpuOffload,
    fault: Fault,
    fingerprint_chunks: AtomicU64,
    compress_units: AtomicU64,
}

impl TestBackend {
    fn new(fault: Fault) -> Arc<Self> {
        Arc::new(TestBackend {
            cpu: CpuOffload::new(),
            fault,
            fingerprint_chunks: AtomicU64::new(0),
            compress_units: AtomicU64::new(0),
        })
    }
}

impl Offload for TestBackend {
    fn name(&self) -> &str {
        "test"
    }

    fn capacity(&self) -> Capacity {
        Capacity { parallel: 4, batch_chunks: 256 }
    }

    fn fingerprint(&self, op: PrintOp, chunks: &[&[u8]], out: &mut [Prints]) -> Result<(), OffloadError> {
        self.fingerprint_chunks.fetch_add(chunks.len() as u64, Ordering::Relaxed);
        if self.fault == Fault::Fails {
            return Err(OffloadError { backend: "test".into(), reason: "device reset".into() });
        }
        self.cpu.fingerprint(op, chunks, out)?;
        for (k, o) in out.iter_mut().enumerate() {
            match self.fault {
                Fault::ConstantFingerprint if op.blake3 => o.blake3 = [7; 32],
                Fault::FalseZeroAndCrc if op.zero_check && k % 2 == 0 => o.zero = true,
                Fault::FalseZeroAndCrc if op.crc32c => o.crc32c = o.crc32c.wrapping_add(1),
                _ => {}
            }
        }
        Ok(())
    }

    fn compress(&self, units: &[CompressUnit<'_>], out: &mut [Compressed]) -> Result<(), OffloadError> {
        self.compress_units.fetch_add(units.len() as u64, Ordering::Relaxed);
        if self.fault == Fault::Fails {
            return Err(OffloadError { backend: "test".into(), reason: "device reset".into() });
        }
        for (k, (u, o)) in units.iter().zip(out.iter_mut()).enumerate() {
            *o = compress_unit(u);
            if self.fault == Fault::CorruptFragments {
                if let Some(f) = o.bytes.as_mut() {
                    if let Some(b) = f.last_mut() {
                        *b ^= 0x5a;
                    }
                    if k % 2 == 1 {
                        f.resize(u.data.len(), 0);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Data blocks `write_mix` repeats from an earlier request: request r = 3k + 2 writes the
/// data of seed k, which an earlier request wrote unless k is itself 2 mod 3 (11 of the 16).
const REPEATED_BLOCKS: u64 = 11 * 60;

/// Writes 48 requests of 64 blocks (one batch each, split across the pool): compressible
/// and random blocks, zero blocks, and every third request the data of an earlier seed.
/// Returns the expected contents by block.
fn write_mix(vol: &Volume) -> Vec<Vec<u8>> {
    let mut want = Vec::new();
    for r in 0..48u64 {
        let src = if r % 3 == 2 { r / 3 } else { r };
        let mut buf = Vec::new();
        for b in 0..64u64 {
            let blk = match b % 16 {
                15 => vec![0u8; 4096],
                11..=14 => block(src * 1000 + b, 1),
                _ => block(src * 1000 + b, 0),
            };
            buf.extend_from_slice(&blk);
        }
        vol.write(r * 64 * 4096, &buf, false).expect("write");
        want.extend(buf.chunks(4096).map(|c| c.to_vec()));
    }
    want
}

fn read_all(vol: &Volume, want: &[Vec<u8>], what: &str) {
    for (lba, w) in want.iter().enumerate() {
        let mut b = vec![0u8; 4096];
        vol.read(lba as u64 * 4096, &mut b).expect("read");
        assert!(&b == w, "{what}: block {lba} reads back other content");
    }
}

/// Writes the mix through `backend` (`predictor`: the unique-chunk predictor's stage 1),
/// checks every block reads back, then reopens with the CPU backend and checks again and
/// audits. Returns the stats of the session with the backend.
fn run(backend: Option<Arc<TestBackend>>, predictor: bool) -> dedupvol_core::Stats {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    vol.close().expect("close");
    let opts = OpenOptions {
        offload: backend.clone().map(|b| b as Arc<dyn Offload>),
        unique_predictor: predictor,
        ..small_open()
    };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open");
    let want = write_mix(&vol);
    read_all(&vol, &want, "same session");
    vol.flush().expect("flush");
    let st = vol.stats();
    vol.close().expect("close");
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("reopen");
    read_all(&vol, &want, "reopened with the CPU backend");
    // Writing the same data again on the CPU backend: old records are compared by bytes.
    let again = write_mix(&vol);
    read_all(&vol, &again, "rewritten with the CPU backend");
    close_and_check(dev, vol);
    st
}

#[test]
fn the_engine_computes_through_the_given_backend_and_stores_the_same() {
    for predictor in [false, true] {
        let b = TestBackend::new(Fault::None);
        let st = run(Some(b.clone()), predictor);
        let o = &st.pipeline.offload;
        assert_eq!((o.backend.as_str(), o.checked, o.parallel), ("test", true, 4));
        assert!(b.fingerprint_chunks.load(Ordering::Relaxed) >= 48 * 64, "every chunk went through the backend");
        assert!(b.compress_units.load(Ordering::Relaxed) > 0);
        assert_eq!(o.fingerprint_chunks, b.fingerprint_chunks.load(Ordering::Relaxed));
        assert_eq!(o.compress_units, b.compress_units.load(Ordering::Relaxed));
        assert_eq!((o.rejected_results, o.failed_calls), (0, 0));
        // The built-in backend stores and shares exactly as much.
        let cpu = run(None, predictor);
        assert_eq!(cpu.pipeline.offload.backend, "cpu");
        assert!(!cpu.pipeline.offload.checked);
        assert_eq!(st.data_blocks_used, cpu.data_blocks_used, "predictor {predictor}");
        assert_eq!(st.counters.dedup_hits, cpu.counters.dedup_hits, "predictor {predictor}");
        assert_eq!(st.counters.zero_blocks, cpu.counters.zero_blocks);
        assert!(st.counters.dedup_hits >= REPEATED_BLOCKS, "the repeated requests were shared: {:?}", st.counters);
    }
}

#[test]
fn a_corrupt_fragment_is_caught_before_it_is_stored() {
    for predictor in [false, true] {
        let st = run(Some(TestBackend::new(Fault::CorruptFragments)), predictor);
        let o = &st.pipeline.offload;
        assert!(o.rejected_results > 0, "{o:?}");
        assert!(st.counters.compressed_blocks > 0, "the CPU compressed the refused units again");
    }
}

#[test]
fn a_wrong_fingerprint_costs_dedup_never_data() {
    // The default volume trusts fingerprints with reuse stamps (hash verification): the
    // backend's session compares every candidate's bytes instead.
    let st = run(Some(TestBackend::new(Fault::ConstantFingerprint)), false);
    assert_eq!(st.pipeline.offload.rejected_results, 0, "a fingerprint cannot be checked without recomputing it");
    assert!(st.counters.dedup_hits < REPEATED_BLOCKS, "dedup is lost, as it should be: {}", st.counters.dedup_hits);
}

#[test]
fn a_false_zero_and_a_wrong_crc_are_recomputed() {
    let st = run(Some(TestBackend::new(Fault::FalseZeroAndCrc)), false);
    let o = &st.pipeline.offload;
    assert!(o.rejected_results >= 48 * 60, "{o:?}");
    assert_eq!(st.counters.zero_blocks, 48 * 4, "only the zero blocks are zero");
}

#[test]
fn a_failing_backend_leaves_the_work_to_the_cpu() {
    let st = run(Some(TestBackend::new(Fault::Fails)), false);
    let o = &st.pipeline.offload;
    assert!(o.failed_calls >= 48, "{o:?}");
    assert!(st.counters.dedup_hits >= REPEATED_BLOCKS, "{:?}", st.counters);
}

#[test]
fn the_cpu_functions_are_the_documented_algorithms() {
    let c = block(3, 0);
    let p = print_chunk(PrintOp { zero_check: true, weak_mask: Some(0xffff), crc32c: true, blake3: true }, &c);
    assert!(!p.zero);
    assert_eq!(p.crc32c, crc32c_of(&c));
    assert_eq!(p.weak >> 16, 0, "the mask applies");
    let z = print_chunk(PrintOp { zero_check: true, weak_mask: None, crc32c: true, blake3: true }, &[0u8; 4096]);
    assert_eq!(z, Prints { zero: true, ..Prints::default() }, "a zero chunk gets nothing else");
}

/// crc32c (Castagnoli), bitwise: the reference the backend's answer is compared with.
fn crc32c_of(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}
