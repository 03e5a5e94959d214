//! Several writer threads on one volume: each owns a region and also writes blocks that
//! duplicate the other threads' data, with concurrent flushes and readers; afterwards every
//! block holds its owner's last write, and the audit is clean.
mod common;
use common::*;
use dedupvol_core::{check_volume, Storage, Volume};
use std::sync::Arc;

const THREADS: u64 = 4;
const BLOCKS_PER_THREAD: u64 = 256;
const ROUNDS: u64 = 6;

fn content(t: u64, lba: u64, round: u64) -> Vec<u8> {
    // A third of the blocks are shared by every thread (dedup across writers).
    if lba.is_multiple_of(3) {
        block(1000 + (lba / 3) % 16 + round, 0)
    } else {
        block(t * 1_000_000 + lba * 100 + round, (lba % 2) as u8)
    }
}

#[test]
fn concurrent_writers_flushers_and_readers() {
    let (dev, vol) =
        mem_volume(64 << 20, THREADS * BLOCKS_PER_THREAD * 4096, |o| o.journal_size_bytes = Some(512 << 10));
    let vol = Arc::new(vol);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let vol = vol.clone();
            s.spawn(move || {
                for round in 0..ROUNDS {
                    for chunk in 0..BLOCKS_PER_THREAD / 8 {
                        let mut buf = Vec::new();
                        for i in 0..8 {
                            buf.extend_from_slice(&content(t, chunk * 8 + i, round));
                        }
                        let off = (t * BLOCKS_PER_THREAD + chunk * 8) * 4096;
                        vol.write(off, &buf, chunk % 7 == 0).expect("write");
                        let mut back = vec![0u8; buf.len()];
                        vol.read(off, &mut back).expect("read");
                        assert!(back == buf, "thread {t} read back other data");
                    }
                    vol.flush().expect("flush");
                }
            });
        }
    });
    for t in 0..THREADS {
        for lba in 0..BLOCKS_PER_THREAD {
            let mut b = vec![0u8; 4096];
            vol.read((t * BLOCKS_PER_THREAD + lba) * 4096, &mut b).expect("read");
            assert!(b == content(t, lba, ROUNDS - 1), "thread {t} block {lba}");
        }
    }
    assert!(vol.stats().counters.dedup_hits > 0);
    vol.audit_memory().expect("memory audit");
    Arc::try_unwrap(vol).ok().expect("sole owner").close().expect("close");
    let r = check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
    let _ = Volume::format;
}

/// Sync policy: every write is durable on return, and concurrent writers share commits
/// (group commit) instead of paying one sync each.
#[test]
fn sync_policy_group_commits_concurrent_writers() {
    /// A device whose sync takes a millisecond, like a real disk's cache flush.
    struct SlowSync(dedupvol_core::MemStorage);
    impl Storage for SlowSync {
        fn read_at(&self, b: &mut [u8], o: u64) -> std::io::Result<()> {
            self.0.read_at(b, o)
        }
        fn write_at(&self, b: &[u8], o: u64) -> std::io::Result<()> {
            self.0.write_at(b, o)
        }
        fn sync(&self) -> std::io::Result<()> {
            std::thread::sleep(std::time::Duration::from_millis(1));
            Ok(())
        }
        fn len(&self) -> u64 {
            self.0.len()
        }
    }
    let dev: Arc<dyn Storage> = Arc::new(SlowSync(dedupvol_core::MemStorage::new(64 << 20)));
    let opts = dedupvol_core::FormatOptions {
        logical_size_bytes: 16 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        write_policy: dedupvol_core::WritePolicy::Sync,
        ..Default::default()
    };
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    let vol = Arc::new(Volume::open(dev, None, &small_open()).expect("open"));
    const WRITES: u64 = 200;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let vol = vol.clone();
            s.spawn(move || {
                for i in 0..WRITES {
                    vol.write((t * WRITES + i) * 4096, &block(t * 10_000 + i, 1), false).expect("write");
                }
            });
        }
    });
    let st = vol.stats();
    assert!(st.counters.commits > 0);
    assert!(
        st.counters.commits < 8 * WRITES,
        "no group commit: {} commits for {} writes",
        st.counters.commits,
        8 * WRITES
    );
    eprintln!("sync policy: {} writes in {} commits", 8 * WRITES, st.counters.commits);
}

/// Small writes from many threads are combined into batches: each thread's blocks read
/// back as its last write, duplicates across threads are shared, requests of different
/// threads never form one extent, and the pipeline's figures add up.
#[test]
fn small_writes_from_many_threads_are_batched_and_land_where_they_were_sent() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |o| o.journal_size_bytes = Some(512 << 10));
    vol.close().expect("close");
    let batch = dedupvol_core::BatchOptions { enabled: true, wait_micros: 50, ..Default::default() };
    let opts = dedupvol_core::OpenOptions { batch, unique_predictor: true, ..small_open() };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open");
    let vol = Arc::new(vol);
    const PER: u64 = 300;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let vol = vol.clone();
            s.spawn(move || {
                for i in 0..PER {
                    // Interleaved blocks: thread t owns every 8th block, so neighbours
                    // on the volume come from different threads (and requests).
                    let lba = (i % 128) * 8 + t;
                    let data =
                        if i % 4 == 0 { block(7_000 + i % 32, 0) } else { block(t * 100_000 + i, (i % 2) as u8) };
                    vol.write(lba * 4096, &data, i % 50 == 0).expect("write");
                }
            });
        }
    });
    for t in 0..8u64 {
        for slot in 0..128u64 {
            // The last write of each slot: the largest i < PER with i % 128 == slot.
            let i = slot + 128 * ((PER - 1 - slot) / 128);
            let want =
                if i.is_multiple_of(4) { block(7_000 + i % 32, 0) } else { block(t * 100_000 + i, (i % 2) as u8) };
            let mut b = vec![0u8; 4096];
            vol.read((slot * 8 + t) * 4096, &mut b).expect("read");
            assert!(b == want, "thread {t} slot {slot}");
        }
    }
    let st = vol.stats();
    let p = &st.pipeline;
    assert_eq!(p.batched_requests, 8 * PER, "every small write went through the batcher");
    assert!(
        p.batches < p.batched_requests && p.batches > 0,
        "{} requests in {} batches",
        p.batched_requests,
        p.batches
    );
    assert_eq!(p.fingerprint.chunks, p.place.chunks);
    assert_eq!(p.queue_chunks, 0);
    assert!(p.latency_p99_micros >= p.latency_p50_micros);
    assert!(st.counters.dedup_hits > 0);
    let pr = &p.predictor;
    assert!(pr.enabled && pr.unique_right + pr.unique_wrong + pr.duplicate_right + pr.duplicate_wrong == 8 * PER);
    vol.audit_memory().expect("memory audit");
    Arc::try_unwrap(vol).ok().expect("sole owner").close().expect("close");
    let r = check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}
