//! Unit tests of the volume that look inside its state.

use super::*;
use crate::config::{DedupVerify, FormatOptions, OpenOptions, BLOCK_SIZE};
use crate::io::{MemStorage, Storage};

/// A 16 MiB volume with a 1 MiB index and 1 MiB slabs.
fn small_format() -> FormatOptions {
    FormatOptions {
        logical_size_bytes: 16 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    }
}

/// With hash verification, a block whose 16-bit reuse stamp wraps must not be shared
/// through a record made 65536 reuses ago, whose stamp matches again: the wrap starts a new
/// index epoch, after which older records are verified byte for byte.
#[test]
fn reuse_stamp_wrap_starts_a_new_epoch() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let opts = FormatOptions { verify: DedupVerify::Hash, ..small_format() };
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open");
    let a: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 7 % 251) as u8).collect();
    let b: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 13 % 241) as u8).collect();
    vol.write(0, &a, false).expect("write a");
    vol.flush().expect("flush");
    let ha = *blake3::hash(&a).as_bytes();
    let pbn = {
        let mut st = vol.state.lock();
        let pbn = st.map.get(0).expect("map").pbn;
        let l = st.dedup.index().lookup(&ha).expect("record");
        assert_eq!((l.pbn, l.stamp, l.current), (pbn, 0, true));
        // As if the block had been freed and reused 65535 times since.
        st.dedup.set_stamp(pbn, u16::MAX);
        pbn
    };
    vol.write(0, &b, false).expect("overwrite frees the block");
    let st = vol.state.lock();
    assert_eq!(st.dedup.stamp(pbn), Some(0));
    let l = st.dedup.index().lookup(&ha).expect("the record stays");
    assert!(!l.current, "a record from before the stamp wrap is still trusted by its stamp");
    assert!(!st.dedup.lookup(&ha, &st.rc, true).0.verified);
    assert_eq!(st.red.stamp_wrap_scans, 1);
}

/// Reuse stamps do not survive a crash, so a record from before it may point at a block
/// freed and reused since, holding other content: it must fail byte verification, never
/// be shared on the strength of its fingerprint.
#[test]
fn a_stale_record_after_a_crash_is_rejected() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let opts =
        FormatOptions { verify: DedupVerify::Hash, compression: crate::config::Compression::None, ..small_format() };
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("open");
    let a = crate::codec::test_random_bytes(1, BLOCK_SIZE);
    vol.write(0, &a, false).expect("a");
    vol.flush().expect("flush");
    drop(vol);
    let vol = Volume::open(dev, None, &OpenOptions::default()).expect("reopen after the crash");
    vol.wait_index_rebuilt();
    let ha = *blake3::hash(&a).as_bytes();
    let pbn = vol.state.lock().dedup.index().lookup(&ha).expect("record rebuilt from the ring").pbn;
    // Free a's block, then store other content until the allocator hands it out again.
    let mut i = 0u64;
    loop {
        vol.write((1 + i % 4000) * BLOCK_SIZE as u64, &crate::codec::test_random_bytes(100 + i, BLOCK_SIZE), false)
            .expect("overwrite");
        if i == 0 {
            vol.write(0, &crate::codec::test_random_bytes(99, BLOCK_SIZE), false).expect("free a");
        }
        if i.is_multiple_of(64) {
            vol.flush().expect("flush");
        }
        if i > 0 && vol.state.lock().rc.get(pbn) > 0 {
            break;
        }
        i += 1;
        assert!(i < 200_000, "block {pbn} was never reused");
    }
    // On the device, so verification reads it rather than comparing the staged copy.
    vol.flush().expect("flush");
    {
        let st = vol.state.lock();
        let cand = st.dedup.lookup(&ha, &st.rc, true).0;
        assert_eq!(cand.loc.map(|l| l.pbn), Some(pbn));
        assert!(!cand.verified, "a record from before the crash was trusted by its stamp");
    }
    let failures = vol.stats().counters.dedup_verify_failures;
    vol.write(4090 * BLOCK_SIZE as u64, &a, false).expect("a again");
    let mut back = vec![0u8; BLOCK_SIZE];
    vol.read(4090 * BLOCK_SIZE as u64, &mut back).expect("read");
    assert!(back == a, "a stale record shared a block holding other data");
    assert_eq!(vol.stats().counters.dedup_verify_failures, failures + 1);
}

/// Raw blocks missing from the cache are read in merged runs; a damaged block inside a
/// run is an error for that block only, and its neighbours still read back.
#[test]
fn merged_raw_reads_check_every_block() {
    let dev = Arc::new(MemStorage::new(64 << 20));
    let opts = small_format();
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    let small = OpenOptions { content_cache_bytes: 64 << 10, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone(), None, &small).expect("open");
    let data = crate::codec::test_random_bytes(0x1234_5678_9abc_def1, 200 * BLOCK_SIZE);
    vol.write(0, &data, false).expect("write");
    vol.flush().expect("flush");
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data, "merged read returned different bytes");
    let pbn = vol.state.lock().map.get(50).expect("map").pbn;
    assert!(vol.state.lock().map.get(51).expect("map").pbn == pbn + 1, "raw blocks are laid out in order");
    dev.write_at(&[0xee; 16], vol.geo.data_offset(pbn) + 100).expect("damage");
    vol.cache.lock().remove(pbn);
    let mut one = vec![0u8; BLOCK_SIZE];
    assert!(matches!(vol.read(50 * BLOCK_SIZE_U64, &mut one), Err(Error::Corruption(_))));
    let mut run = vec![0u8; 40 * BLOCK_SIZE];
    assert!(matches!(vol.read(30 * BLOCK_SIZE_U64, &mut run), Err(Error::Corruption(_))));
    vol.read(0, &mut back[..50 * BLOCK_SIZE]).expect("blocks before the damage");
    assert!(back[..50 * BLOCK_SIZE] == data[..50 * BLOCK_SIZE]);
    vol.read(51 * BLOCK_SIZE_U64, &mut back[51 * BLOCK_SIZE..]).expect("blocks after the damage");
    assert!(back[51 * BLOCK_SIZE..] == data[51 * BLOCK_SIZE..]);
}

/// A crash tore superblock copy B; the next superblock write must go to B first, so that a
/// second crash tearing that write leaves copy A valid. With a fixed A-then-B order the
/// second crash tore A too and the volume could no longer be opened (both copies bad).
#[test]
fn superblock_write_overwrites_the_stale_copy_first() {
    struct Recording {
        inner: MemStorage,
        writes: parking_lot::Mutex<Vec<u64>>,
    }
    impl Storage for Recording {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            self.writes.lock().push(offset);
            self.inner.write_at(buf, offset)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
        fn len(&self) -> u64 {
            self.inner.len()
        }
    }
    let dev = Arc::new(Recording { inner: MemStorage::new(64 << 20), writes: parking_lot::Mutex::new(Vec::new()) });
    let opts = small_format();
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    for (torn, first_write) in [(BLOCK_SIZE_U64, BLOCK_SIZE_U64), (0, 0)] {
        dev.inner.write_at(&[0x5a; 64], torn + 200).expect("tear a copy");
        dev.writes.lock().clear();
        let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("open with one good copy");
        let sb_writes: Vec<u64> = dev.writes.lock().iter().copied().filter(|&o| o < 2 * BLOCK_SIZE_U64).collect();
        assert_eq!(sb_writes.first(), Some(&first_write), "the valid copy was overwritten first: {sb_writes:?}");
        vol.close().expect("close");
    }
}

/// The whole-structure audits pass on a volume in use and name the structure whose
/// invariant a deliberate break violates: an index entry outside the data region, and a
/// referenced block handed back to the allocator.
#[test]
fn structure_audits_pass_and_catch_a_broken_invariant() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let opts = small_format();
    Volume::format(dev.clone(), None, &opts, false).expect("format");
    let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open");
    let data: Vec<u8> = (0..64 * BLOCK_SIZE).map(|i| (i / 512 % 7) as u8 * (i % 3) as u8).collect();
    vol.write(0, &data, false).expect("write");
    vol.write(1 << 20, &data, false).expect("write duplicates");
    vol.audit_structures(&vol.state.lock()).expect("unsent writes audit clean");
    vol.flush().expect("flush");
    vol.audit_structures(&vol.state.lock()).expect("flushed volume audits clean");

    let mut st = vol.state.lock();
    let beyond = MapEntry::raw(vol.geo.data_blocks + 3, 0);
    st.dedup.record(&[7u8; 32], &beyond);
    let err = vol.audit_structures(&st).expect_err("an index entry outside the data region");
    assert!(err.starts_with("dedup index"), "{err}");
    st.dedup.forget_damaged(beyond.pbn);
    vol.audit_structures(&st).expect("entry forgotten");

    let pbn = st.map.get(0).expect("map").pbn;
    st.alloc.unreserve(pbn);
    let err = vol.audit_structures(&st).expect_err("a referenced block free in the allocator");
    assert!(err.starts_with("allocator"), "{err}");
}

/// Packed blocks that are consecutive on the device are read with one request when a read
/// needs them and the cache lacks them (they used to cost one 4 KiB device read each), and
/// a damaged one inside such a run still fails only its own logical blocks.
#[test]
fn consecutive_packed_blocks_are_read_in_one_request() {
    let dev = Arc::new(MemStorage::new(64 << 20));
    Volume::format(dev.clone(), None, &small_format(), false).expect("format");
    let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("open");
    // Three quarters of each block repeat one byte: compressible, packed about three to a block.
    let data: Vec<u8> = crate::codec::test_random_bytes(0x5eed, 256 * BLOCK_SIZE)
        .chunks(BLOCK_SIZE)
        .flat_map(|b| {
            let mut v = b.to_vec();
            v.iter_mut().skip(BLOCK_SIZE / 4).for_each(|x| *x = 0x61);
            v
        })
        .collect();
    vol.write(0, &data, false).expect("write");
    vol.close().expect("close");
    let cold = OpenOptions { content_cache_bytes: 64 << 10, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone(), None, &cold).expect("reopen");
    let packed = vol.stats().data_blocks_used;
    assert!(packed > 64 && packed < 128, "{packed} blocks: the data should pack about three to a block");
    let before = vol.stats().io.data_read.ops;
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data, "read returned different bytes");
    let reads = vol.stats().io.data_read.ops - before;
    assert!(reads <= 8, "{reads} device reads for {packed} packed blocks");
    // Damage one packed block: only the logical blocks it holds fail.
    let pbn = vol.state.lock().map.get(100).expect("map").pbn;
    dev.write_at(&[0xee; 16], vol.geo.data_offset(pbn) + 200).expect("damage");
    vol.cache.lock().remove(pbn);
    let mut run = vec![0u8; 64 * BLOCK_SIZE];
    assert!(matches!(vol.read(80 * BLOCK_SIZE_U64, &mut run), Err(Error::Corruption(_))));
    let mut ok = vec![0u8; 32 * BLOCK_SIZE];
    vol.read(0, &mut ok).expect("blocks far from the damage");
    assert!(ok[..] == data[..32 * BLOCK_SIZE]);
}

/// A volume made by a build that saved its index at close holds that save (a `DVIX`
/// header and entries) where the chapter ring now lives, and counts its entries in the
/// superblock: it must still open, skip the old contents as invalid pages, and index anew.
#[test]
fn an_index_saved_by_an_older_build_is_skipped() {
    let mem: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    Volume::format(mem.clone(), None, &small_format(), false).expect("format");
    let dev = crate::io::Dev::new(mem.clone(), Arc::new(crate::io::IoCounters::default()));
    let (mut sb, _) = crate::metadata::superblock::Superblock::read(&dev, 0).expect("superblock");
    let geo = sb.geometry;
    let mut old = vec![0u8; 4 * BLOCK_SIZE];
    old[..4].copy_from_slice(b"DVIX");
    crate::codec::put_u64(&mut old, 8, 3);
    crate::codec::put_u32(&mut old, 16, 40);
    old[BLOCK_SIZE..].iter_mut().enumerate().for_each(|(i, b)| *b = (i * 31 % 251) as u8);
    dev.write(crate::io::IoKind::Index, &old, geo.index_start * BLOCK_SIZE as u64).expect("old save");
    sb.index_saved_entries = 3;
    super::lifecycle::write_superblock(&dev, None, &mut sb).expect("superblock");

    let vol = Volume::open(mem.clone(), None, &OpenOptions::default()).expect("open");
    let s = vol.stats().index;
    assert_eq!((s.rebuild_records, s.chapters_used), (0, 1), "{s:?}");
    let a = crate::codec::test_random_bytes(5, 8 * BLOCK_SIZE);
    vol.write(0, &a, false).expect("write");
    vol.write(1 << 20, &a, false).expect("write again");
    assert_eq!(vol.stats().counters.dedup_hits, 8);
    vol.close().expect("close");
    let vol = Volume::open(mem, None, &OpenOptions::default()).expect("reopen");
    vol.wait_index_rebuilt();
    assert_eq!(vol.stats().index.rebuild_records, 8);
    vol.close().expect("close");
}

/// The batcher takes an offload backend's batch size hint as the chunks a waiting leader
/// wants, unless the caller set its own; without a backend it waits for `chunks_max`.
#[test]
fn the_backends_batch_hint_sizes_batches() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    Volume::format(dev.clone(), None, &small_format(), false).expect("format");
    let backend: Arc<dyn crate::pipeline::offload::Offload> = Arc::new(crate::pipeline::offload::CpuOffload::new());
    let hint = backend.capacity().batch_chunks;
    for (offload, wanted, expect) in [(None, 0, 1024), (Some(backend.clone()), 0, hint), (Some(backend), 128, 128)] {
        let batch = crate::pipeline::batcher::BatchOptions { chunks_wanted: wanted, ..Default::default() };
        let vol =
            Volume::open(dev.clone(), None, &OpenOptions { offload, batch, ..OpenOptions::default() }).expect("open");
        assert_eq!(vol.batcher.chunks_wanted(), expect);
        vol.close().expect("close");
    }
}

/// A device whose reads fail once `down` is set: every read with `TimedOut`, as a RADOS
/// device's do with every OSD down and an operation timeout (`unanswering`), or the reads
/// touching two blocks from byte `at` with an error that is not a timeout, as a bad sector
/// (`bad_sector`). It counts the reads it failed.
struct FailingReads {
    inner: MemStorage,
    kind: std::io::ErrorKind,
    /// u64::MAX: every read fails.
    at: std::sync::atomic::AtomicU64,
    down: std::sync::atomic::AtomicBool,
    failed_reads: std::sync::atomic::AtomicU64,
}

impl FailingReads {
    /// A 64 MiB device, answering; once down, it answers no read in time.
    fn unanswering() -> Arc<FailingReads> {
        Self::new(std::io::ErrorKind::TimedOut, u64::MAX)
    }

    /// A 64 MiB device, answering; once down, two blocks from byte `at` (set it later)
    /// cannot be read.
    fn bad_sector() -> Arc<FailingReads> {
        Self::new(std::io::ErrorKind::Other, 0)
    }

    fn new(kind: std::io::ErrorKind, at: u64) -> Arc<FailingReads> {
        Arc::new(FailingReads {
            inner: MemStorage::new(64 << 20),
            kind,
            at: at.into(),
            down: false.into(),
            failed_reads: 0.into(),
        })
    }
}

impl Storage for FailingReads {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let at = self.at.load(std::sync::atomic::Ordering::Relaxed);
        let touches = at == u64::MAX || (offset < at + 2 * BLOCK_SIZE_U64 && offset + buf.len() as u64 > at);
        if touches && self.down.load(std::sync::atomic::Ordering::Relaxed) {
            self.failed_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(std::io::Error::new(self.kind, "simulated read failure"));
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn name(&self) -> String {
        "failing-reads".to_string()
    }
}

/// Formats `storage`, writes `data` at 0 in a session opened with `opts`, and reopens the
/// volume (default options) with every block map page cached: from then on only data and
/// index reads reach the device.
fn reopened_with_the_map_cached(
    storage: &Arc<dyn Storage>,
    format: &FormatOptions,
    opts: &OpenOptions,
    data: &[u8],
) -> Volume {
    Volume::format(storage.clone(), None, format, false).expect("format");
    let vol = Volume::open(storage.clone(), None, opts).expect("open");
    vol.write(0, data, false).expect("write");
    vol.close().expect("close");
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("reopen");
    vol.wait_index_rebuilt();
    {
        let mut st = vol.state.lock();
        for l in 0..vol.logical_blocks() {
            st.map.get(l).expect("map entry");
        }
    }
    vol
}

/// A background pass whose scan meets a block map page the device does not answer for ends
/// with the error after asking once, rather than asking again for each entry of the page
/// under the state lock (each one a device timeout: the server stopped answering for hours
/// with every OSD of a RADOS volume down). The volume then serves again when the device does.
#[test]
fn a_background_scan_asks_an_unanswering_device_once() {
    use std::sync::atomic::Ordering;
    let dev = FailingReads::unanswering();
    let storage: Arc<dyn Storage> = dev.clone();
    Volume::format(storage.clone(), None, &small_format(), false).expect("format");
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("open");
    let data = crate::codec::test_random_bytes(3, 64 * BLOCK_SIZE);
    vol.write(0, &data, false).expect("write");
    vol.close().expect("close");
    for pass in ["recompress", "clean"] {
        // Reopened: no map page is cached, so the scan must read them.
        let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("reopen");
        vol.wait_index_rebuilt();
        dev.failed_reads.store(0, Ordering::Relaxed);
        dev.down.store(true, Ordering::Relaxed);
        let failed = match pass {
            "recompress" => vol.recompress(&super::recompress::RecompressOptions::default()).is_err(),
            _ => vol.clean(&super::cleaner::CleanOptions::default()).is_err(),
        };
        let asked = dev.failed_reads.load(Ordering::Relaxed);
        assert!(failed, "{pass}: a pass whose map could not be read succeeded");
        assert!(asked <= 2, "{pass}: the device was asked {asked} times for what it did not answer");
        dev.down.store(false, Ordering::Relaxed);
        let mut back = vec![0u8; data.len()];
        vol.read(0, &mut back).expect("read once the device answers");
        assert!(back == data, "{pass}: data differs once the device answers");
        vol.close().expect("close");
    }
}

/// A recompression pass whose fragment reads get no answer in time ends at the first,
/// rather than waiting out a timeout for each fragment left (a server stopping waits for
/// the pass).
#[test]
fn a_pass_ends_at_a_fragment_read_the_device_does_not_answer() {
    use std::sync::atomic::Ordering;
    let dev = FailingReads::unanswering();
    let storage: Arc<dyn Storage> = dev.clone();
    let format = FormatOptions { compression: crate::config::Compression::Zstd, rest_level: Some(0), ..small_format() };
    // Written with the fast codec: every fragment is left for recompression.
    let fast = OpenOptions { store_codec: Some((crate::config::Compression::Lz4, 0)), ..OpenOptions::default() };
    let data: Vec<u8> = (0..256 * BLOCK_SIZE).map(|i| ((i / 16) % 251) as u8 ^ (i / BLOCK_SIZE) as u8).collect();
    // Every map page cached: only the fragments' reads reach the device.
    let vol = reopened_with_the_map_cached(&storage, &format, &fast, &data);
    dev.down.store(true, Ordering::Relaxed);
    let got = vol.recompress(&super::recompress::RecompressOptions::default());
    let asked = dev.failed_reads.load(Ordering::Relaxed);
    assert!(got.is_err(), "a pass whose fragments could not be read succeeded: {got:?}");
    assert_eq!(asked, 1, "the device was asked {asked} times for what it did not answer");
    dev.down.store(false, Ordering::Relaxed);
    let report = vol.recompress(&super::recompress::RecompressOptions::default()).expect("a pass once it answers");
    assert!(report.fragments_recompressed > 0, "nothing was left to recompress: {report:?}");
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data, "data differs after the passes");
    vol.close().expect("close");
}

/// Duplicate lookups stop reading record pages for a while after one such read got no
/// answer in time: each read would cost the write batch a device timeout, for dedup only.
#[test]
fn lookups_stop_asking_a_device_that_does_not_answer() {
    use std::sync::atomic::Ordering;
    let dev = FailingReads::unanswering();
    let storage: Arc<dyn Storage> = dev.clone();
    let format = FormatOptions { compression: crate::config::Compression::None, ..small_format() };
    let data = crate::codec::test_random_bytes(11, 1024 * BLOCK_SIZE);
    // Every map page cached: only record pages are left to read.
    let vol = reopened_with_the_map_cached(&storage, &format, &OpenOptions::default(), &data);
    let half = (vol.logical_blocks() / 2) as usize;
    dev.down.store(true, Ordering::Relaxed);
    // The same blocks again elsewhere, one request per block: duplicates to look up.
    for (i, b) in data.chunks(BLOCK_SIZE).enumerate() {
        vol.write(((half + i) * BLOCK_SIZE) as u64, b, false).expect("a write accepted into memory");
    }
    let asked = dev.failed_reads.load(Ordering::Relaxed);
    assert!(asked > 0, "no record page was read: the test does not test anything");
    assert!(asked <= 4, "record pages were asked for {asked} times from a device that does not answer");
}

/// A block map page that cannot be read (a persistent error, not a timeout) is skipped by
/// background passes, which go on with the rest of the map: the cleaner still compacts,
/// and the recompressor still settles, what the other pages map. Before, such a page
/// ended every pass where it stood, so nothing past it was ever cleaned. What the bad page
/// maps stays where it is, and everything reads back once the device reads it again.
#[test]
fn background_passes_skip_a_map_page_with_a_persistent_read_error() {
    use crate::config::Compression;
    use std::sync::atomic::Ordering;
    let blocks = 6144usize;
    // Past the pages an open reads ahead of its first map lookup (they stay cached).
    let page = 20u64;
    let first = page * crate::metadata::layout::BM_ENTRIES_PER_PAGE;
    let dev = FailingReads::bad_sector();
    let format = FormatOptions {
        compression: Compression::Zstd,
        // No rest level: the cleaner copies fragments as they are, and leaves the fast
        // codec's to the recompressor.
        rest_level: Some(0),
        logical_size_bytes: (blocks * BLOCK_SIZE) as u64,
        ..small_format()
    };
    Volume::format(dev.clone(), None, &format, false).expect("format");
    let meta = crate::io::Dev::new(dev.clone(), Arc::new(crate::io::IoCounters::default()));
    let (sb, _) = crate::metadata::superblock::Superblock::read(&meta, 0).expect("superblock");
    dev.at.store((sb.geometry.block_map_start + 2 * page) * BLOCK_SIZE_U64, Ordering::Relaxed);
    let storage: Arc<dyn Storage> = dev.clone();
    // Written with the fast codec, then the first half of every other extent overwritten:
    // half-dead blocks to clean, and fragments to bring to zstd, on every page.
    let fast = OpenOptions { store_codec: Some((Compression::Lz4, 0)), ..OpenOptions::default() };
    let vol = Volume::open(storage.clone(), None, &fast).expect("open");
    let mut data: Vec<u8> = (0..blocks * BLOCK_SIZE).map(|i| ((i / 16) % 251) as u8 ^ (i / BLOCK_SIZE) as u8).collect();
    vol.write(0, &data, false).expect("write");
    for unit in (0..blocks / 16).step_by(2) {
        for k in 0..8 {
            let lba = unit * 16 + k;
            let fresh = crate::codec::test_random_bytes(lba as u64, BLOCK_SIZE / 2).repeat(2);
            vol.write((lba * BLOCK_SIZE) as u64, &fresh, false).expect("overwrite");
            data[lba * BLOCK_SIZE..(lba + 1) * BLOCK_SIZE].copy_from_slice(&fresh);
        }
    }
    vol.close().expect("close");
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("reopen");
    vol.wait_index_rebuilt();
    // No map page cached (the journal's replay read them), so the passes must read them.
    vol.flush().expect("flush");
    vol.state.lock().map.drop_clean_pages();
    dev.down.store(true, Ordering::Relaxed);
    let c = vol.clean(&super::cleaner::CleanOptions { budget_bytes: u64::MAX, live_max: BLOCK_SIZE as u32 });
    let c = c.expect("a cleaner pass past a bad map page");
    assert_eq!(c.map_pages_unreadable, 1, "{c:?}");
    assert!(c.fragments_moved > 0 && c.blocks_remapped > 0, "nothing cleaned past the bad page: {c:?}");
    assert_eq!(c.scanned_blocks, vol.logical_blocks(), "{c:?}");
    vol.flush().expect("flush");
    let r = vol.recompress(&super::recompress::RecompressOptions::default());
    let r = r.expect("a recompression pass past a bad map page");
    assert_eq!(r.map_pages_unreadable, 1, "{r:?}");
    assert!(r.fragments_recompressed > 0, "nothing recompressed past the bad page: {r:?}");
    let asked = dev.failed_reads.load(Ordering::Relaxed);
    // Once in a failed read-ahead and once alone, then once a pass: never once per entry
    // (254 a pass), nor once per read-ahead of the pages before it.
    assert!(asked <= 4, "the bad page was asked for {asked} times in two passes");
    // What the bad page maps cannot be read now; the rest reads back.
    let mut one = vec![0u8; BLOCK_SIZE];
    assert!(vol.read(first * BLOCK_SIZE_U64, &mut one).is_err(), "a block mapped by the bad page was read");
    let far = (first + crate::metadata::layout::BM_ENTRIES_PER_PAGE) as usize;
    let mut rest = vec![0u8; (blocks - far) * BLOCK_SIZE];
    vol.read((far * BLOCK_SIZE) as u64, &mut rest).expect("read past the bad page");
    assert!(rest[..] == data[far * BLOCK_SIZE..], "data past the bad page differs");
    vol.flush().expect("flush");
    dev.down.store(false, Ordering::Relaxed);
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read once the page reads again");
    assert!(back == data, "data differs once the page reads again");
    vol.close().expect("close");
    let report = crate::check::check_volume(storage, None, false).expect("check");
    assert!(report.is_clean(), "{report:?}");
}

/// A crash that leaves nothing to replay, because the first journal block after a
/// checkpoint was torn (the blocks after it, written with it, were never durable), must
/// bring back the space counters as of that checkpoint. They came from the superblock,
/// which held them only as of the last clean close, so the volume went on with stale
/// counters and `check` found them wrong (the simulator's seed 71418: recovery was the
/// checkpoint, and a torn first block followed it).
#[test]
fn a_crash_with_nothing_to_replay_keeps_the_checkpoints_counters() {
    let mem = Arc::new(MemStorage::new(64 << 20));
    let storage: Arc<dyn Storage> = mem.clone();
    Volume::format(storage.clone(), None, &small_format(), false).expect("format");
    // First session: data and zeroes, then a crash (dropped, not closed).
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("open");
    let data = crate::codec::test_random_bytes(21, 64 * BLOCK_SIZE);
    vol.write(0, &data, false).expect("write");
    vol.write_zeroes(64 * BLOCK_SIZE_U64, 32 * BLOCK_SIZE_U64, false).expect("zeroes");
    vol.flush().expect("flush");
    drop(vol);
    // Second session: recovery replays the first and checkpoints. Then more than one
    // journal block of changes in one commit, and a crash.
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("reopen");
    let (first_block, journal_start, journal_blocks) = {
        let st = vol.state.lock();
        (st.journal.next_block_seq(), vol.geo.journal_start, vol.geo.journal_blocks)
    };
    for lba in 200..400u64 {
        vol.write(lba * BLOCK_SIZE_U64, &data[..BLOCK_SIZE], false).expect("write one block");
    }
    vol.flush().expect("flush");
    assert!(vol.state.lock().journal.next_block_seq() >= first_block + 2, "one journal block only");
    drop(vol);
    // The first block after the checkpoint torn: the crash came before the commit's sync.
    let torn = vec![0xa5u8; BLOCK_SIZE];
    mem.write_at(&torn, (journal_start + first_block % journal_blocks) * BLOCK_SIZE_U64).expect("tear");
    let vol = Volume::open(storage.clone(), None, &OpenOptions::default()).expect("open after the crash");
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data, "the first session's data differs");
    vol.close().expect("close");
    let report = crate::check::check_volume(storage, None, false).expect("check");
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// Regression: the cleaner's dead-space hint added a whole extent's compressed length for
/// every one of its blocks that was overwritten, so random overwrites of extent data
/// counted up to 16 times the bytes that died and ran full-map cleaner passes that often.
/// Each block overwritten now adds its share of the unit, and all of them add up to the
/// fragment once.
#[test]
fn overwriting_one_block_of_an_extent_counts_its_share_as_dead() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let fmt = FormatOptions { extent_blocks_max: Some(16), ..small_format() };
    Volume::format(dev.clone(), None, &fmt, false).expect("format");
    let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open");
    let text: Vec<u8> =
        (0..16 * BLOCK_SIZE).map(|i| b"one extent of sixteen blocks "[i % 29] ^ (i / 512) as u8).collect();
    vol.write(0, &text, false).expect("one 64 KiB extent");
    vol.flush().expect("flush");
    let frag = {
        let mut st = vol.state.lock();
        let e = st.map.get(3).expect("map");
        e.fragment_of().expect("stored compressed")
    };
    assert_eq!(frag.unit_blocks(), 16, "the write is one extent");
    let share = u64::from(frag.len).div_ceil(16);
    let other = crate::codec::test_random_bytes(9, 16 * BLOCK_SIZE);
    let before = vol.dead_bytes_hint();
    vol.write(3 * BLOCK_SIZE as u64, other.get(..BLOCK_SIZE).expect("a block"), false).expect("one block");
    assert_eq!(vol.dead_bytes_hint() - before, share, "one block of sixteen: its share of the extent");
    for k in 0..16u64 {
        let at = k as usize * BLOCK_SIZE;
        vol.write(k * BLOCK_SIZE as u64, other.get(at..at + BLOCK_SIZE).expect("a block"), false).expect("write");
    }
    let all = vol.dead_bytes_hint() - before;
    assert_eq!(all, 16 * share, "every block once: the fragment, rounded up per block");
    assert!(all < u64::from(frag.len) + 16);
}

/// A block of an LZ4 fragment that spans several blocks, recorded by an earlier session, is
/// shared only when the rest of its unit vouches for it: every other decoded block hashes
/// to a record of the index (simulator seed 840358: a dead
/// fragment's reused tail parsed, with the compared block intact, and was shared). Written
/// again block by block after a restart, an intact extent is vouched for and shared, and
/// its records are renewed; zstd fragments are checked by their frame's checksum. Both
/// verification modes.
#[test]
fn a_multi_block_lz4_fragment_of_an_earlier_session_is_shared_when_its_unit_vouches() {
    use crate::config::Compression;
    // Half random, half repeated: compressible, and too large for one block.
    let noise = crate::codec::test_random_bytes(5, 4 * BLOCK_SIZE);
    let text: Vec<u8> =
        noise.iter().enumerate().map(|(i, &r)| if i / 64 % 2 == 0 { r } else { b"extent"[i % 6] }).collect();
    let block = |k: usize| text.get(k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE).expect("a block");
    for verify in [DedupVerify::Hash, DedupVerify::Bytes] {
        for codec in [Compression::Lz4, Compression::Zstd] {
            let what = format!("{codec:?}, {verify:?}");
            let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
            let opts = FormatOptions { verify, compression: codec, ..small_format() };
            Volume::format(dev.clone(), None, &opts, false).expect("format");
            let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("open");
            vol.write(0, &text, false).expect("one extent");
            vol.flush().expect("flush");
            let e = vol.state.lock().map.get(1).expect("map");
            assert!(e.fragment_of().is_some_and(|f| f.unit_blocks() == 4) && e.span() > 1, "{what}: {e:?}");
            let hits = |v: &Volume| v.stats().counters.dedup_hits;
            let before = hits(&vol);
            vol.write(100 * BLOCK_SIZE as u64, block(1), false).expect("a duplicate");
            assert_eq!(hits(&vol), before + 1, "{what}: a duplicate in the same session is shared");
            vol.close().expect("close");
            let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open again");
            vol.wait_index_rebuilt();
            let before = hits(&vol);
            vol.write(101 * BLOCK_SIZE as u64, block(2), false).expect("a duplicate after a restart");
            assert_eq!(hits(&vol), before + 1, "{what}: a duplicate of an earlier session's intact extent");
            let shared = vol.state.lock().map.get(101).expect("map");
            assert_eq!((shared.pbn, shared.frag.off), (e.pbn, e.frag.off), "{what}: shared with the extent");
            let mut b = vec![0u8; BLOCK_SIZE];
            vol.read(101 * BLOCK_SIZE as u64, &mut b).expect("read");
            assert_eq!(b, block(2), "{what}");
            // Its other blocks come next, as a copy of the extent would.
            for k in [0, 3] {
                let before = hits(&vol);
                vol.write((110 + k as u64) * BLOCK_SIZE as u64, block(k), false).expect("another duplicate");
                assert_eq!(hits(&vol), before + 1, "{what}: block {k}");
            }
            vol.close().expect("close");
        }
    }
}

/// The extent cap is the volume's: formatted at 16 KiB, a 64 KiB write becomes extents of
/// 4 blocks; raised while open, the next write forms 16-block extents; a reopen (with
/// the open's own cap left at its default) keeps the raised cap; and an open's smaller cap
/// wins over the volume's. Out-of-range caps are refused and change nothing.
#[test]
fn the_extent_cap_is_a_volume_setting_that_can_change() {
    let text = |seed: usize| -> Vec<u8> {
        (0..16 * BLOCK_SIZE).map(|i| b"extents capped by the volume "[i % 29] ^ ((i / 512 + seed) as u8)).collect()
    };
    let units = |vol: &Volume, lba0: u64| -> Vec<usize> {
        let mut st = vol.state.lock();
        (lba0..lba0 + 16)
            .map(|l| st.map.get(l).expect("map").fragment_of().expect("stored compressed").unit_blocks())
            .collect()
    };
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let fmt = FormatOptions { extent_blocks_max: Some(4), ..small_format() };
    Volume::format(dev.clone(), None, &fmt, false).expect("format");
    let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("open");
    assert_eq!(vol.extent_max(), 4);
    assert_eq!(vol.stats().extent_blocks_max, 4);
    vol.write(0, &text(0), false).expect("64 KiB");
    assert!(units(&vol, 0).iter().all(|&u| u == 4), "capped at 4 blocks: {:?}", units(&vol, 0));
    for bad in [0u8, 17] {
        assert!(matches!(vol.set_extent_blocks_max(bad), Err(Error::InvalidArgument(_))), "cap {bad} taken");
    }
    assert_eq!(vol.set_extent_blocks_max(16).expect("raise"), 4);
    vol.write(16 * BLOCK_SIZE as u64, &text(1), false).expect("64 KiB");
    assert!(units(&vol, 16).iter().all(|&u| u == 16), "one extent now: {:?}", units(&vol, 16));
    vol.close().expect("close");
    let vol = Volume::open(dev.clone(), None, &OpenOptions::default()).expect("reopen");
    assert_eq!(vol.extent_max(), 16, "the raised cap is the volume's");
    vol.close().expect("close");
    let vol = Volume::open(dev, None, &OpenOptions { extent_blocks_max: 2, ..OpenOptions::default() }).expect("open");
    assert_eq!(vol.extent_max(), 2, "the open's smaller cap wins");
    vol.write(32 * BLOCK_SIZE as u64, &text(2), false).expect("64 KiB");
    assert!(units(&vol, 32).iter().all(|&u| u == 2), "{:?}", units(&vol, 32));
    vol.close().expect("close");
}

/// Text of a shared vocabulary, different in every block: what a dictionary helps.
fn vocabulary_text(blocks: usize, seed: u64) -> Vec<u8> {
    let words = ["fn ", "let ", "mut ", "self", ".map(", "|x| ", "Result<", "Option<", "impl ", "pub ", "{\n", "}\n"];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(blocks * BLOCK_SIZE + 16);
    while v.len() < blocks * BLOCK_SIZE {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(words[(x % words.len() as u64) as usize].as_bytes());
        v.extend_from_slice(format!("{}", x % 1000).as_bytes());
    }
    v.truncate(blocks * BLOCK_SIZE);
    v
}

/// The dictionary's life: a zstd volume with a rest level gets 16 KiB extents by default;
/// its first settling of enough data trains a dictionary, installs it (version 6) and
/// stores its units with it, smaller than without; a reopen reads everything back and
/// `check` is clean; a damaged first copy is survived through the second; both damaged
/// refuse the open as corruption of the dictionary area.
#[test]
fn settling_trains_a_dictionary_that_survives_reopen_and_one_damaged_copy() {
    use crate::metadata::superblock::{Superblock, FORMAT_VERSION_DICT, FORMAT_VERSION_REST};
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let fmt = FormatOptions { rest_level: Some(6), ..small_format() };
    Volume::format(dev.clone(), None, &fmt, false).expect("format");
    let opts = OpenOptions { dictionary_train_min_bytes: 1 << 20, ..OpenOptions::default() };
    let data = vocabulary_text(1024, 7);
    let settled_bytes = |train_min: usize| {
        let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
        Volume::format(dev.clone(), None, &fmt, false).expect("format");
        let vol =
            Volume::open(dev.clone(), None, &OpenOptions { dictionary_train_min_bytes: train_min, ..opts.clone() })
                .expect("open");
        vol.write(0, &data, false).expect("write");
        vol.flush().expect("flush");
        vol.settle(&crate::volume::recompress::RecompressOptions::default(), &|| false).expect("settle");
        let s = vol.stats();
        vol.close().expect("close");
        (s.physical_data_bytes_used, s.dictionary)
    };
    let (without, none) = settled_bytes(usize::MAX);
    assert_eq!(none, None, "no training below the minimum");
    let (with, dict) = settled_bytes(1 << 20);
    assert!(dict.is_some(), "settling 4 MiB trained a dictionary");
    assert!(with < without, "units at rest store less with the dictionary: {with} against {without}");

    let vol = Volume::open(dev.clone(), None, &opts).expect("open");
    assert_eq!(vol.extent_max(), crate::config::DEFAULT_EXTENT_BLOCKS_DICT, "16 KiB extents by default");
    vol.write(0, &data, false).expect("write");
    vol.flush().expect("flush");
    let sb_version = |dev: &Arc<dyn Storage>| {
        let d = crate::io::Dev::new(dev.clone(), Arc::new(crate::io::IoCounters::default()));
        let (sb, _) = Superblock::read(&d, 0).expect("superblock");
        let mut b = vec![0u8; BLOCK_SIZE];
        dev.read_at(&mut b, 0).expect("read");
        (u32::from_le_bytes(b[12..16].try_into().expect("4")), sb)
    };
    assert_eq!(sb_version(&dev).0, FORMAT_VERSION_REST);
    vol.settle(&crate::volume::recompress::RecompressOptions::default(), &|| false).expect("settle");
    let info = vol.stats().dictionary.expect("a dictionary");
    vol.close().expect("close");
    let (version, sb) = sb_version(&dev);
    assert_eq!(version, FORMAT_VERSION_DICT);
    assert_eq!(sb.dictionary.map(|d| (d.id, d.len)), Some(info));
    let area = sb.geometry.dict_area();

    let read_all = |dev: &Arc<dyn Storage>| -> crate::error::Result<Vec<u8>> {
        let vol = Volume::open(dev.clone(), None, &opts)?;
        let mut back = vec![0u8; data.len()];
        vol.read(0, &mut back)?;
        vol.close()?;
        Ok(back)
    };
    assert!(read_all(&dev).expect("reopen") == data, "read back after reopen");
    let report = crate::check::check_volume(dev.clone(), None, false).expect("check");
    assert!(report.is_clean(), "{:?}", report.problems);
    // The first copy damaged: the second serves.
    let junk = vec![0x5a; BLOCK_SIZE];
    dev.write_at(&junk, area.start * BLOCK_SIZE as u64).expect("damage copy A");
    assert!(read_all(&dev).expect("open with copy B") == data);
    // Both damaged: the open says what is wrong, and nothing is decoded with a wrong one.
    dev.write_at(&junk, (area.start + area.end) / 2 * BLOCK_SIZE as u64).expect("damage copy B");
    match read_all(&dev) {
        Err(crate::error::Error::Corruption(c)) => assert_eq!(c.structure, "dictionary area"),
        other => panic!("expected corruption of the dictionary area, got {:?}", other.map(|_| ())),
    }
}

/// A zstd volume with a rest level holding `vocabulary_text(1024, seed)`, settled (so with
/// its dictionary), closed: the device and the data.
fn settled_with_dictionary(seed: u64) -> (Arc<dyn Storage>, Vec<u8>, OpenOptions) {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let fmt = FormatOptions { rest_level: Some(6), ..small_format() };
    Volume::format(dev.clone(), None, &fmt, false).expect("format");
    let opts = OpenOptions { dictionary_train_min_bytes: 1 << 20, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone(), None, &opts).expect("open");
    let data = vocabulary_text(1024, seed);
    vol.write(0, &data, false).expect("write");
    vol.flush().expect("flush");
    vol.settle(&crate::volume::recompress::RecompressOptions::default(), &|| false).expect("settle");
    assert!(vol.stats().dictionary.is_some(), "settling trained a dictionary");
    vol.close().expect("close");
    (dev, data, opts)
}

/// Copy `c` (0: A, 1: B) of the dictionary of the volume on `dev` (`len` bytes).
fn dictionary_copy(dev: &Arc<dyn Storage>, area: &std::ops::Range<u64>, c: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    let half = (area.end - area.start) / 2;
    dev.read_at(&mut b, (area.start + c * half) * BLOCK_SIZE as u64).expect("read");
    b
}

/// Scrub checks both copies of the volume's dictionary: a damaged copy is reported, and
/// with repair written again from the dictionary in use (the device's copy then matches
/// the other), after which a scrub finds nothing.
#[test]
fn scrub_reports_and_repairs_a_damaged_dictionary_copy() {
    let (dev, data, opts) = settled_with_dictionary(11);
    let vol = Volume::open(dev.clone(), None, &opts).expect("open");
    let (_, len) = vol.stats().dictionary.expect("a dictionary");
    let area = vol.geo.dict_area();
    let copy = |c| dictionary_copy(&dev, &area, c, len as usize);
    assert!(copy(0) == copy(1), "two equal copies");
    let good = copy(1);
    let half = (area.end - area.start) / 2;
    dev.write_at(&vec![0xa5; BLOCK_SIZE], (area.start + half) * BLOCK_SIZE as u64).expect("damage copy B");
    let scrub = |repair| vol.scrub(&crate::check::scrub::ScrubOptions { repair, ..Default::default() }).expect("scrub");
    let found = scrub(false);
    assert_eq!(found.status.metadata_damaged, 1, "{:?}", found.metadata);
    assert!(found.metadata.iter().any(|m| m.contains("dictionary copy B")), "{:?}", found.metadata);
    let repaired = scrub(true);
    assert!(repaired.is_clean(), "{:?}", repaired.metadata);
    assert!(copy(1) == good, "copy B written again");
    assert!(scrub(false).is_clean());
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data);
    vol.close().expect("close");
}

/// `check` audits both copies of the dictionary too: a damaged copy is a problem, `check
/// --repair` writes it again, and the next check is clean.
#[test]
fn check_reports_and_repairs_a_damaged_dictionary_copy() {
    let (dev, data, _) = settled_with_dictionary(13);
    let (sb, _) = crate::metadata::superblock::Superblock::read(
        &crate::io::Dev::new(dev.clone(), Arc::new(crate::io::IoCounters::default())),
        0,
    )
    .expect("superblock");
    let (area, len) = (sb.geometry.dict_area(), sb.dictionary.expect("a dictionary").len as usize);
    let good = dictionary_copy(&dev, &area, 0, len);
    dev.write_at(&vec![0x3c; BLOCK_SIZE], area.start * BLOCK_SIZE as u64).expect("damage copy A");
    let found = crate::check::check_volume(dev.clone(), None, false).expect("check");
    assert!(!found.is_clean());
    assert!(found.problems.iter().any(|p| p.to_string().contains("dictionary copy A")), "{:?}", found.problems);
    let repaired = crate::check::check_volume(dev.clone(), None, true).expect("check --repair");
    assert!(repaired.repaired.iter().any(|r| r.contains("dictionary copy A")), "{:?}", repaired.repaired);
    assert!(dictionary_copy(&dev, &area, 0, len) == good, "copy A written again");
    let again = crate::check::check_volume(dev.clone(), None, false).expect("check");
    assert!(again.is_clean(), "{:?}", again.problems);
    let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open");
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data);
    vol.close().expect("close");
}
