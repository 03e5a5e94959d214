//! Model-based property test: random writes, overwrites, discards, write-zeroes, FUA,
//! flushes, clean close/reopen and drop-without-close, checked against a map of the
//! contents each block may hold under the durability contract (docs/design.md).
mod common;
use common::*;
use dedupvol_core::{check_volume, Compression, DedupVerify, Storage, Volume, WritePolicy};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

const LOGICAL_BLOCKS: u64 = 192;

#[derive(Debug, Clone)]
enum Op {
    Write {
        lba: u64,
        n: u64,
        seed: u64,
        kind: u8,
        fua: bool,
    },
    Unaligned {
        off: u64,
        len: u64,
        seed: u64,
    },
    Discard {
        lba: u64,
        n: u64,
    },
    Zeroes {
        lba: u64,
        n: u64,
        fua: bool,
    },
    Flush,
    Reopen,
    Crash,
    /// A cleaner pass taking as victims the blocks with at most this many live bytes.
    Clean {
        live_max: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..LOGICAL_BLOCKS, 1..8u64, 0..12u64, 0..3u8, any::<bool>())
            .prop_map(|(lba, n, seed, kind, fua)| Op::Write { lba, n, seed, kind, fua: fua && seed % 4 == 0 }),
        2 => (0..LOGICAL_BLOCKS * 4096, 1..9000u64, 0..1000u64).prop_map(|(off, len, seed)| Op::Unaligned { off, len, seed }),
        2 => (0..LOGICAL_BLOCKS, 1..16u64).prop_map(|(lba, n)| Op::Discard { lba, n }),
        1 => (0..LOGICAL_BLOCKS, 1..16u64, any::<bool>()).prop_map(|(lba, n, fua)| Op::Zeroes { lba, n, fua }),
        2 => Just(Op::Flush),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        1 => prop_oneof![Just(2048u32), Just(4096u32)].prop_map(|live_max| Op::Clean { live_max }),
    ]
}

/// For every block, the contents it may hold: the last durable one first, then later writes.
struct Model {
    allowed: HashMap<u64, Vec<Vec<u8>>>,
}

impl Model {
    fn set(&mut self, lba: u64, data: Vec<u8>, durable: bool) {
        let v = self.allowed.entry(lba).or_insert_with(|| vec![vec![0u8; 4096]]);
        if durable {
            v.clear();
        }
        v.push(data);
    }
    fn last(&self, lba: u64) -> Vec<u8> {
        self.allowed.get(&lba).and_then(|v| v.last().cloned()).unwrap_or_else(|| vec![0u8; 4096])
    }
    fn flush(&mut self) {
        for v in self.allowed.values_mut() {
            let last = v.pop().unwrap_or_else(|| vec![0u8; 4096]);
            v.clear();
            v.push(last);
        }
    }
}

fn run(ops: Vec<Op>, policy: WritePolicy, verify: DedupVerify, compression: Compression) -> Result<(), TestCaseError> {
    run_with(ops, policy, verify, compression, true, None)
}

/// Write-once journaling's journal in the model tests: the first 32 logical blocks. Writes
/// draw from a few contents, so a block written there is often written elsewhere later.
const WOJ_JOURNAL_BLOCKS: u64 = 32;

/// `run`, with dedup on or off and, when `woj_mask` is given, write-once journaling on
/// with the weak hash cut to that mask.
fn run_with(
    ops: Vec<Op>,
    policy: WritePolicy,
    verify: DedupVerify,
    compression: Compression,
    dedup: bool,
    woj_mask: Option<u64>,
) -> Result<(), TestCaseError> {
    let (dev, vol) = mem_volume(12 << 20, LOGICAL_BLOCKS * 4096, |o| {
        o.write_policy = policy;
        o.verify = verify;
        o.compression = compression;
        o.journal_size_bytes = Some(256 << 10);
        o.index_memory_bytes = 64 << 10;
        o.dedup = dedup;
    });
    let open_opts = match woj_mask {
        Some(mask) => dedupvol_core::OpenOptions {
            woj: dedupvol_core::WojMode::Range { offset: 0, len: WOJ_JOURNAL_BLOCKS * 4096 },
            woj_weak_hash_mask: mask,
            ..small_open()
        },
        None => small_open(),
    };
    // The volume `mem_volume` opened has no WOJ: reopen it with these options.
    let vol = match woj_mask {
        Some(_) => {
            vol.close().map_err(|e| TestCaseError::fail(format!("close: {e}")))?;
            Volume::open(dev.clone() as Arc<dyn Storage>, None, &open_opts)
                .map_err(|e| TestCaseError::fail(format!("open: {e}")))?
        }
        None => vol,
    };
    let mut vol = Some(vol);
    let mut m = Model { allowed: HashMap::new() };
    let sync = policy == WritePolicy::Sync;
    let paranoid = std::env::var_os("DEDUPVOL_MODEL_PARANOID").is_some();
    for (step, op) in ops.into_iter().enumerate() {
        if paranoid {
            let v = vol.as_ref().expect("open volume");
            if let Err(e) = v.audit_memory() {
                prop_assert!(false, "before step {step} ({op:?}): {e}");
            }
            for lba in 0..LOGICAL_BLOCKS {
                let mut b = vec![0u8; 4096];
                let r = v.read(lba * 4096, &mut b);
                prop_assert!(r.is_ok() && b == m.last(lba), "before step {step} ({op:?}): lba {lba} wrong: {r:?}");
            }
        }
        let v = vol.as_ref().expect("open volume");
        match op {
            Op::Write { lba, n, seed, kind, fua } => {
                let n = n.min(LOGICAL_BLOCKS - lba);
                let mut buf = Vec::new();
                for i in 0..n {
                    let b = match kind {
                        2 => vec![0u8; 4096],
                        k => block(seed * 31 + i % 3, k),
                    };
                    buf.extend_from_slice(&b);
                }
                v.write(lba * 4096, &buf, fua).map_err(|e| TestCaseError::fail(format!("write: {e}")))?;
                for (i, b) in (0..n).zip(buf.chunks_exact(4096)) {
                    m.set(lba + i, b.to_vec(), fua || sync);
                }
            }
            Op::Unaligned { off, len, seed } => {
                let len = len.min(LOGICAL_BLOCKS * 4096 - off);
                let data: Vec<u8> = (0..len).map(|i| (seed as u8).wrapping_add(i as u8 / 7)).collect();
                v.write(off, &data, false).map_err(|e| TestCaseError::fail(format!("unaligned write: {e}")))?;
                let first = off / 4096;
                let last = (off + len - 1) / 4096;
                for lba in first..=last {
                    let mut b = m.last(lba);
                    for (i, byte) in (0u64..).zip(b.iter_mut()) {
                        let p = lba * 4096 + i;
                        if let Some(&d) = p.checked_sub(off).and_then(|k| data.get(k as usize)) {
                            *byte = d;
                        }
                    }
                    m.set(lba, b, sync);
                }
            }
            Op::Discard { lba, n } | Op::Zeroes { lba, n, .. } => {
                let n = n.min(LOGICAL_BLOCKS - lba);
                let fua = matches!(op, Op::Zeroes { fua: true, .. });
                let r = if matches!(op, Op::Discard { .. }) {
                    v.discard(lba * 4096, n * 4096)
                } else {
                    v.write_zeroes(lba * 4096, n * 4096, fua)
                };
                r.map_err(|e| TestCaseError::fail(format!("discard/zeroes: {e}")))?;
                for i in 0..n {
                    m.set(lba + i, vec![0u8; 4096], fua || sync);
                }
            }
            Op::Flush => {
                v.flush().map_err(|e| TestCaseError::fail(format!("flush: {e}")))?;
                m.flush();
            }
            Op::Clean { live_max } => {
                // Moves data, changes no content: the model is unchanged.
                v.clean(&dedupvol_core::CleanOptions { budget_bytes: u64::MAX, live_max })
                    .map_err(|e| TestCaseError::fail(format!("clean: {e}")))?;
                v.audit_memory().map_err(|e| TestCaseError::fail(format!("audit after clean: {e}")))?;
                for lba in 0..LOGICAL_BLOCKS {
                    let mut b = vec![0u8; 4096];
                    v.read(lba * 4096, &mut b).map_err(|e| TestCaseError::fail(format!("read after clean: {e}")))?;
                    prop_assert!(b == m.last(lba), "lba {lba} changed content in a cleaner pass");
                }
            }
            Op::Reopen => {
                vol.take().expect("vol").close().map_err(|e| TestCaseError::fail(format!("close: {e}")))?;
                m.flush();
                vol = Some(
                    Volume::open(dev.clone() as Arc<dyn Storage>, None, &open_opts)
                        .map_err(|e| TestCaseError::fail(format!("reopen: {e}")))?,
                );
            }
            Op::Crash => {
                drop(vol.take());
                let v2 = Volume::open(dev.clone() as Arc<dyn Storage>, None, &open_opts)
                    .map_err(|e| TestCaseError::fail(format!("recover: {e}")))?;
                // Each block must read back one allowed content; that content is now durable.
                for lba in 0..LOGICAL_BLOCKS {
                    let mut b = vec![0u8; 4096];
                    v2.read(lba * 4096, &mut b)
                        .map_err(|e| TestCaseError::fail(format!("read after crash lba {lba}: {e}")))?;
                    let allowed = m.allowed.get(&lba).cloned().unwrap_or_else(|| vec![vec![0u8; 4096]]);
                    prop_assert!(allowed.contains(&b), "lba {lba} holds content that was never allowed after a crash");
                    m.set(lba, b, true);
                }
                v2.close().map_err(|e| TestCaseError::fail(format!("close: {e}")))?;
                let rep = check_volume(dev.clone() as Arc<dyn Storage>, None, false)
                    .map_err(|e| TestCaseError::fail(format!("check: {e}")))?;
                prop_assert!(rep.is_clean(), "check after crash: {:?}", rep.problems);
                vol = Some(
                    Volume::open(dev.clone() as Arc<dyn Storage>, None, &open_opts)
                        .map_err(|e| TestCaseError::fail(format!("reopen: {e}")))?,
                );
            }
        }
    }
    let v = vol.take().expect("vol");
    for lba in 0..LOGICAL_BLOCKS {
        let mut b = vec![0u8; 4096];
        v.read(lba * 4096, &mut b).map_err(|e| TestCaseError::fail(format!("final read {lba}: {e}")))?;
        prop_assert!(b == m.last(lba), "lba {lba} differs from the last write");
    }
    v.close().map_err(|e| TestCaseError::fail(format!("close: {e}")))?;
    let rep =
        check_volume(dev as Arc<dyn Storage>, None, false).map_err(|e| TestCaseError::fail(format!("check: {e}")))?;
    prop_assert!(rep.is_clean(), "final check: {:?}", rep.problems);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn async_lz4_bytes(ops in prop::collection::vec(op(), 1..120)) {
        run(ops, WritePolicy::Async, DedupVerify::Bytes, Compression::Lz4)?;
    }

    #[test]
    fn sync_zstd_hash(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, WritePolicy::Sync, DedupVerify::Hash, Compression::Zstd)?;
    }

    #[test]
    fn async_uncompressed(ops in prop::collection::vec(op(), 1..120)) {
        run(ops, WritePolicy::Async, DedupVerify::Bytes, Compression::None)?;
    }

    /// The paper's configuration: write-once journaling without the fingerprint index.
    #[test]
    fn woj_without_dedup(ops in prop::collection::vec(op(), 1..120)) {
        run_with(ops, WritePolicy::Async, DedupVerify::Hash, Compression::Lz4, false, Some(u64::MAX))?;
    }

    /// Write-once journaling first, BLAKE3 dedup behind it, with a 2-bit weak hash: every
    /// lookup of a write outside the journal collides, and a wrong share would fail the
    /// model.
    #[test]
    fn woj_forced_collisions_with_dedup(ops in prop::collection::vec(op(), 1..120)) {
        run_with(ops, WritePolicy::Async, DedupVerify::Bytes, Compression::None, true, Some(0x3))?;
    }

    #[test]
    fn woj_forced_collisions_sync_zstd(ops in prop::collection::vec(op(), 1..80)) {
        run_with(ops, WritePolicy::Sync, DedupVerify::Hash, Compression::Zstd, false, Some(0x3))?;
    }
}
