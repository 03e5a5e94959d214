//! The recompressor: data stored with LZ4 on a zstd volume (a session opened with
//! `OpenOptions::store_codec`, as a write path that defers zstd under a burst stores it)
//! is brought to zstd. Every byte reads back, `check` is clean, and the volume ends within
//! 1% of the space the same data takes written inline with zstd; single blocks become
//! extents again; the idle cleaner thread does it by itself; a crash in the middle loses
//! nothing. A volume with a rest level settles everything written, once, at that level.

mod common;

use common::{close_and_check, small_open};
use dedupvol_core::{
    check_volume, CleanOptions, Cleaner, CleanerOptions, Compression, FormatOptions, MemStorage, OpenOptions,
    RecompressOptions, Storage, Volume,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const B: usize = 4096;

/// Text-like data: words from a small vocabulary picked by a xorshift, so LZ4 and zstd
/// both shrink it, zstd by more. Every 64th block repeats an earlier one (duplicates).
fn data(blocks: usize, seed: u64) -> Vec<u8> {
    const WORDS: &[&str] = &[
        "block ",
        "volume ",
        "fragment ",
        "extent ",
        "journal ",
        "the ",
        "of ",
        "and ",
        "to ",
        "index ",
        "map ",
        "zstd ",
        "lz4 ",
        "codec ",
        "unit ",
        "run ",
        "cleaner ",
        "pass ",
        "crc ",
        "page ",
        "0x3f ",
        "1024 ",
        "—",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out: Vec<u8> = Vec::with_capacity(blocks * B);
    for i in 0..blocks {
        if i % 64 == 63 {
            let src = (i / 2) * B;
            let copy: Vec<u8> = out.get(src..src + B).expect("an earlier block").to_vec();
            out.extend_from_slice(&copy);
            continue;
        }
        let start = out.len();
        while out.len() < start + B {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = WORDS.get((x % WORDS.len() as u64) as usize).copied().unwrap_or_default().as_bytes();
            if x.is_multiple_of(11) {
                out.extend_from_slice(format!("{:08x} ", x >> 32).as_bytes());
            } else {
                out.extend_from_slice(w);
            }
        }
        out.truncate(start + B);
    }
    out
}

/// A zstd volume without a rest level: the recompressor's target is the volume's codec.
fn format(dev: &Arc<MemStorage>, logical: u64) {
    format_rest(dev, logical, 0);
}

/// A zstd volume (level 1) with rest level `rest` (0: off).
fn format_rest(dev: &Arc<MemStorage>, logical: u64, rest: i8) {
    let opts = FormatOptions {
        logical_size_bytes: logical,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        compression: Compression::Zstd,
        rest_level: Some(rest),
        // 64 KiB extents, as the inline volumes these are compared with (a rest level
        // alone would make them 16 KiB, compressed at rest with a dictionary).
        extent_blocks_max: Some(16),
        ..FormatOptions::default()
    };
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &opts, false).expect("format");
}

fn open(dev: &Arc<MemStorage>, store: Option<Compression>) -> Volume {
    let opts = OpenOptions { store_codec: store.map(|c| (c, 0)), ..small_open() };
    Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open")
}

fn write_all(vol: &Volume, data: &[u8], request: usize) {
    for (k, r) in data.chunks(request).enumerate() {
        vol.write((k * request) as u64, r, false).expect("write");
    }
    vol.flush().expect("flush");
}

/// Physical data blocks in use once everything is durable.
fn used(vol: &Volume) -> u64 {
    vol.flush().expect("flush");
    vol.stats().data_blocks_used
}

/// A volume holding `d` written inline with zstd in `request`-byte writes: its blocks used.
fn inline_zstd(d: &[u8], request: usize) -> u64 {
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    let vol = open(&dev, None);
    write_all(&vol, d, request);
    let n = used(&vol);
    vol.close().expect("close");
    n
}

/// Runs passes until none finds anything; returns the passes' reports summed.
fn recompress_all(vol: &Volume, budget: u64) -> (u64, u64, u64, u64) {
    let (mut passes, mut before, mut after, mut bytes) = (0, 0, 0, 0);
    loop {
        let r = vol.recompress(&RecompressOptions { budget_bytes: budget }).expect("recompress");
        passes += 1;
        before += r.bytes_before;
        after += r.bytes_after;
        bytes += r.bytes_recompressed;
        if !r.more && r.fragments_found == r.fragments_recompressed {
            // One more: nothing of another codec is left.
            let last = vol.recompress(&RecompressOptions { budget_bytes: budget }).expect("last pass");
            assert_eq!(last.fragments_found, 0, "{last:?}");
            return (passes, before, after, bytes);
        }
        vol.flush().expect("flush between passes");
        assert!(passes < 1000, "the recompressor does not converge");
    }
}

/// A cleaner thread that looks every 20 ms, never cleans, and runs recompression passes
/// of 1 MiB once no client has written or read for `idle`.
fn recompressing_thread(vol: &Arc<Volume>, idle: Duration) -> Cleaner {
    Cleaner::spawn_with(
        vol,
        CleanerOptions {
            interval: Duration::from_millis(20),
            trigger_bytes: u64::MAX,
            clean: CleanOptions::default(),
            recompress: Some(RecompressOptions { budget_bytes: 1 << 20 }),
            idle,
            duty: dedupvol_core::CLEANER_DUTY_DEFAULT,
        },
    )
    .expect("spawn")
}

/// Reads `want` back, closes the volume, checks it is clean, and opens it again.
fn reopened_clean(dev: &Arc<MemStorage>, vol: Volume, want: &[u8]) -> Volume {
    read_back(&vol, want);
    vol.close().expect("close");
    let rep = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(rep.is_clean(), "{:?}", rep.problems);
    open(dev, None)
}

fn read_back(vol: &Volume, want: &[u8]) {
    let mut back = vec![0u8; want.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == want, "content changed by the recompressor");
}

#[test]
fn lz4_data_on_a_zstd_volume_ends_within_one_percent_of_inline_zstd() {
    let d = data(4096, 7); // 16 MiB
    let inline = inline_zstd(&d, 128 << 10);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    let vol = open(&dev, Some(Compression::Lz4));
    write_all(&vol, &d, 128 << 10);
    vol.close().expect("close");
    let vol = open(&dev, None);
    let lz4 = used(&vol);
    assert!(vol.recompress_hint() > 0, "an open does not know there is nothing to do");
    assert!(lz4 as f64 > inline as f64 * 1.05, "LZ4 should take more room: {lz4} vs {inline}");
    let t = Instant::now();
    let (passes, before, after, bytes) = recompress_all(&vol, 4 << 20);
    let secs = t.elapsed().as_secs_f64();
    let end = used(&vol);
    eprintln!(
        "recompressed {bytes} logical bytes in {passes} passes, {secs:.2} s: fragments {before} -> {after} bytes; \
         blocks used: LZ4 {lz4}, after {end}, inline zstd {inline} ({:.2}x -> {:.2}x, inline {:.2}x)",
        d.len() as f64 / (lz4 as f64 * 4096.0),
        d.len() as f64 / (end as f64 * 4096.0),
        d.len() as f64 / (inline as f64 * 4096.0),
    );
    assert!(passes > 1, "a 4 MiB budget takes several passes for 16 MiB");
    assert!(
        (end as f64 - inline as f64).abs() <= inline as f64 * 0.01,
        "after recompression {end} blocks, inline zstd {inline}"
    );
    let s = vol.stats();
    assert_eq!(s.counters.recompress_bytes, bytes);
    assert_eq!(s.counters.recompress_bytes_saved, before - after);
    assert!(s.counters.recompress_passes >= passes);
    assert_eq!(vol.recompress_hint(), 0);
    let vol = reopened_clean(&dev, vol, &d);
    read_back(&vol, &d);
    vol.close().expect("close");
}

#[test]
fn single_blocks_become_extents_again() {
    let d = data(1024, 11);
    // Written a block at a time, each block is compressed alone.
    let inline_single = inline_zstd(&d, B);
    let inline_extents = inline_zstd(&d, 128 << 10);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    let vol = open(&dev, Some(Compression::Lz4));
    write_all(&vol, &d, B);
    vol.close().expect("close");
    let vol = open(&dev, None);
    recompress_all(&vol, 64 << 20);
    let end = used(&vol);
    assert!(end < inline_single, "extents again: {end} blocks, single zstd blocks {inline_single}");
    assert!((end as f64) <= inline_extents as f64 * 1.02, "{end} blocks against {inline_extents} for inline extents");
    read_back(&vol, &d);
    close_and_check(dev, vol);
}

#[test]
fn overwrites_and_discards_during_recompression_keep_the_newest_data() {
    let mut d = data(2048, 3);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    let vol = open(&dev, Some(Compression::Lz4));
    write_all(&vol, &d, 64 << 10);
    vol.close().expect("close");
    let vol = open(&dev, None);
    // A pass on a small budget, then overwrites (some of them over data still LZ4), a
    // discard, and passes to the end.
    vol.recompress(&RecompressOptions { budget_bytes: 1 << 20 }).expect("first pass");
    let fresh = data(64, 99);
    for k in 0..16usize {
        let at = (k * 97 % 2000) * B;
        vol.write(at as u64, &fresh[k * B..(k + 1) * B], false).expect("overwrite");
        d[at..at + B].copy_from_slice(&fresh[k * B..(k + 1) * B]);
    }
    vol.discard((1500 * B) as u64, (8 * B) as u64).expect("discard");
    d[1500 * B..1508 * B].fill(0);
    recompress_all(&vol, 2 << 20);
    read_back(&vol, &d);
    // The cleaner afterwards finds the blocks the overwrites left partly dead.
    vol.clean(&CleanOptions::default()).expect("clean");
    read_back(&vol, &d);
    close_and_check(dev, vol);
}

#[test]
fn a_crash_inside_recompression_loses_nothing() {
    let d = data(2048, 5);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    let vol = open(&dev, Some(Compression::Lz4));
    write_all(&vol, &d, 128 << 10);
    vol.close().expect("close");
    let vol = open(&dev, None);
    // One pass made durable, one not: a crash (drop without close) after the second.
    vol.recompress(&RecompressOptions { budget_bytes: 2 << 20 }).expect("pass");
    vol.flush().expect("flush");
    vol.recompress(&RecompressOptions { budget_bytes: 2 << 20 }).expect("pass");
    drop(vol);
    let vol = open(&dev, None);
    read_back(&vol, &d);
    recompress_all(&vol, 64 << 20);
    read_back(&vol, &d);
    close_and_check(dev, vol);
}

#[test]
fn the_cleaner_thread_recompresses_once_writes_stop() {
    let d = data(1024, 13);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format(&dev, 64 << 20);
    // The same session stores with LZ4 and runs the thread: the volume's codec is zstd.
    let vol = Arc::new(open(&dev, Some(Compression::Lz4)));
    let cleaner = recompressing_thread(&vol, Duration::from_millis(100));
    write_all(&vol, &d, 128 << 10);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = vol.stats();
        if s.counters.recompress_bytes >= d.len() as u64 * 63 / 64 && vol.recompress_hint() == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not recompressed in 60 s: {:?}", s.counters);
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(cleaner);
    let last = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(last.fragments_found, 0, "{last:?}");
    read_back(&vol, &d);
    let vol = Arc::into_inner(vol).expect("the thread let the volume go");
    close_and_check(dev, vol);
}

/// A fresh 64 MiB volume with rest level `rest`, opened with its codec, holding
/// `data(blocks, seed)` written in `request`-byte writes: the data, the device, the volume.
fn rest_volume_with(blocks: usize, seed: u64, rest: i8, request: usize) -> (Vec<u8>, Arc<MemStorage>, Volume) {
    let d = data(blocks, seed);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format_rest(&dev, 64 << 20, rest);
    let vol = open(&dev, None);
    write_all(&vol, &d, request);
    (d, dev, vol)
}

/// The volume's format version, from the superblock's first copy.
fn version(dev: &Arc<MemStorage>) -> u32 {
    let mut b = vec![0u8; B];
    dev.read_at(&mut b, 0).expect("read superblock");
    u32::from_le_bytes(b.get(12..16).and_then(|w| w.try_into().ok()).expect("4 bytes"))
}

/// A volume with a rest level: writes compress at level 1 and take what inline level 1
/// takes; passes then compress every fragment again at the rest level and mark it
/// settled. It ends smaller, every byte reads back, `check` is clean, the superblock says
/// version 4, and after a reopen (whose first pass reads the whole map) nothing is taken
/// again. New writes after that are settled by the next passes, and only they.
#[test]
fn a_rest_level_settles_every_fragment_once() {
    let d = data(4096, 17);
    let inline = inline_zstd(&d, 128 << 10);
    let dev = Arc::new(MemStorage::new(64 << 20));
    format_rest(&dev, 64 << 20, 6);
    assert_eq!(version(&dev), dedupvol_core::format::FORMAT_VERSION_REST);
    let vol = open(&dev, None);
    assert_eq!(vol.stats().rest_level, 6);
    write_all(&vol, &d, 128 << 10);
    let written = used(&vol);
    assert!((written as f64 - inline as f64).abs() <= inline as f64 * 0.01, "{written} vs inline {inline}");
    assert!(vol.recompress_hint() > 0, "writes leave data to settle");
    let (passes, before, after, bytes) = recompress_all(&vol, 4 << 20);
    let end = used(&vol);
    eprintln!(
        "settled {bytes} logical bytes in {passes} passes: fragments {before} -> {after} bytes; blocks {written} -> {end}"
    );
    assert!(bytes >= d.len() as u64 * 63 / 64 - (d.len() / 64) as u64, "nearly every block recompressed: {bytes}");
    assert!((end as f64) < inline as f64 * 0.98, "level 6 at rest: {end} blocks against {inline} at level 1");
    assert_eq!(vol.recompress_hint(), 0);
    let vol = reopened_clean(&dev, vol, &d);
    let first = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(first.fragments_found, 0, "settled fragments are taken again: {first:?}");
    assert!(first.scanned_blocks > 0, "the first pass after an open reads the map");
    // New data: only it is settled.
    let fresh = data(256, 23);
    vol.write(0, &fresh, false).expect("write");
    vol.flush().expect("flush");
    let (_, _, _, again) = recompress_all(&vol, 64 << 20);
    assert!(again <= fresh.len() as u64, "only the new data is settled: {again} bytes");
    assert!(again >= fresh.len() as u64 / 2, "the new data is settled: {again} bytes");
    let mut want = d.clone();
    want[..fresh.len()].copy_from_slice(&fresh);
    read_back(&vol, &want);
    close_and_check(dev, vol);
}

/// A pass that remaps more blocks than the journal holds commits as it goes: it used to
/// leave every entry pending until the next flush, whose commit then failed the volume
/// ("journal overflow"; seen settling 2.7 GB of kernel tars in one run of passes).
#[test]
fn a_pass_larger_than_the_journal_commits_as_it_goes() {
    let d = data(8192, 29); // 32 MiB: 8,192 remaps in one pass
    let dev = Arc::new(MemStorage::new(96 << 20));
    let opts = FormatOptions {
        logical_size_bytes: 64 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        compression: Compression::Zstd,
        rest_level: Some(3),
        // 64 journal blocks: about 6,500 entries.
        journal_size_bytes: Some(256 << 10),
        ..FormatOptions::default()
    };
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &opts, false).expect("format");
    let vol = open(&dev, None);
    write_all(&vol, &d, 128 << 10);
    let r = vol.recompress(&RecompressOptions { budget_bytes: 1 << 30 }).expect("one pass over everything");
    assert!(r.blocks_remapped >= 8000, "{r:?}");
    vol.flush().expect("the flush after the pass");
    read_back(&vol, &d);
    close_and_check(dev, vol);
}

/// Idle work waits for reads too: while a client keeps reading, the cleaner thread does
/// not settle (it would take the CPU from a read-only load); once reads stop it does.
#[test]
fn reads_hold_off_settling_until_they_stop() {
    let (d, dev, vol) = rest_volume_with(1024, 31, 6, 128 << 10);
    let vol = Arc::new(vol);
    // Idle after a second: long beside the reads' pace (a reader would have to stall that
    // long).
    let cleaner = recompressing_thread(&vol, Duration::from_secs(1));
    let reading_until = Instant::now() + Duration::from_secs(3);
    let mut buf = vec![0u8; B];
    let mut k = 0usize;
    while Instant::now() < reading_until {
        vol.read(((k % 1024) * B) as u64, &mut buf).expect("read");
        k += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(vol.stats().counters.recompress_bytes, 0, "settled while a client was reading");
    let deadline = Instant::now() + Duration::from_secs(60);
    while vol.recompress_hint() > 0 || vol.stats().counters.recompress_bytes == 0 {
        assert!(Instant::now() < deadline, "not settled in 60 s after reads stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(cleaner);
    read_back(&vol, &d);
    let vol = Arc::into_inner(vol).expect("the thread let the volume go");
    close_and_check(dev, vol);
}

/// A fragment the rest level cannot shrink enough is settled where it is: with the rest
/// level equal to the write level nothing is written again, only marked; no block more is
/// used, every byte reads back, and a duplicate written afterwards shares the marked
/// fragment (the index records name the marked entries: else the next pass would find
/// the duplicate's mapping unmarked and store its block again).
#[test]
fn fragments_that_do_not_shrink_are_settled_in_place() {
    let (d, dev, vol) = rest_volume_with(2048, 37, 1, 64 << 10);
    let before = used(&vol);
    let r = vol.settle(&RecompressOptions::default(), &|| false).expect("settle");
    assert!(r.fragments_marked > 0 && r.blocks_marked > 0, "{r:?}");
    assert_eq!(vol.stats().counters.recompress_fragments_marked, r.fragments_marked);
    assert_eq!(r.bytes_after, 0, "nothing worth writing again: {r:?}");
    assert!(!r.more, "{r:?}");
    assert_eq!(used(&vol), before);
    read_back(&vol, &d);
    // A duplicate of an extent, written after the marking.
    let at = 1800 * B;
    vol.write(at as u64, &d[..64 << 10], false).expect("duplicate");
    vol.flush().expect("flush");
    assert_eq!(used(&vol), before, "the duplicate is shared");
    let again = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(again.fragments_found, 0, "the duplicate's mappings carry the mark: {again:?}");
    let mut want = d.clone();
    want.copy_within(..64 << 10, at);
    read_back(&vol, &want);
    close_and_check(dev, vol);
}

/// A volume formatted without a rest level gets one later, on the open volume: the change
/// is durable at once (superblock version 2 -> 4, the level kept across a reopen), the
/// data written before it is settled by the next passes, and everything reads back. A
/// level cannot be removed, a level out of range, an LZ4 volume and a read-only session
/// are refused, and none of those refusals changes the volume.
#[test]
fn a_rest_level_added_to_an_existing_volume_settles_its_data() {
    let (d, dev, vol) = rest_volume_with(2048, 41, 0, 128 << 10);
    assert_eq!(version(&dev), dedupvol_core::format::FORMAT_VERSION);
    let r = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(r.fragments_found, 0, "no rest level: level-1 fragments are at rest: {r:?}");
    let before = used(&vol);
    for bad in [0i8, -1, 20] {
        assert!(vol.set_rest_level(bad).is_err(), "rest level {bad} accepted");
    }
    assert_eq!(vol.rest_level(), 0);
    assert_eq!(version(&dev), dedupvol_core::format::FORMAT_VERSION, "a refused change wrote the superblock");
    assert_eq!(vol.set_rest_level(6).expect("set"), 0);
    assert_eq!(vol.rest_level(), 6);
    assert_eq!(version(&dev), dedupvol_core::format::FORMAT_VERSION_REST, "durable at once");
    assert_eq!(vol.set_rest_level(6).expect("same level"), 6);
    let (_, _, _, bytes) = recompress_all(&vol, 4 << 20);
    assert!(bytes >= d.len() as u64 / 2, "the data written before is settled: {bytes} bytes");
    let after = used(&vol);
    assert!(after < before, "level 6 at rest stores less: {before} -> {after} blocks");
    assert!(vol.set_rest_level(0).is_err(), "a rest level was taken away");
    let vol = reopened_clean(&dev, vol, &d);
    assert_eq!(vol.rest_level(), 6);
    assert_eq!(vol.stats().rest_level, 6);
    let r = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(r.fragments_found, 0, "settled fragments are taken again after the reopen: {r:?}");
    // A higher level later: only what is not settled yet gets it (here: nothing).
    assert_eq!(vol.set_rest_level(9).expect("raise"), 6);
    let r = vol.recompress(&RecompressOptions::default()).expect("pass");
    assert_eq!(r.fragments_found, 0, "settled fragments keep their level: {r:?}");
    vol.close().expect("close");
    // Read-only sessions and LZ4 volumes are refused.
    let ro = Volume::open(dev.clone() as Arc<dyn Storage>, None, &OpenOptions { read_only: true, ..small_open() })
        .expect("open read-only");
    assert!(ro.set_rest_level(3).is_err(), "a read-only session changed the rest level");
    assert_eq!(ro.rest_level(), 9);
    drop(ro);
    let lz4 = Arc::new(MemStorage::new(16 << 20));
    let opts = FormatOptions {
        logical_size_bytes: 16 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        compression: Compression::Lz4,
        ..FormatOptions::default()
    };
    Volume::format(lz4.clone() as Arc<dyn Storage>, None, &opts, false).expect("format lz4");
    let vol = open(&lz4, None);
    assert!(vol.set_rest_level(6).is_err(), "an LZ4 volume took a rest level");
    assert_eq!(version(&lz4), dedupvol_core::format::FORMAT_VERSION);
    close_and_check(lz4, vol);
}

/// In a volume with a rest level, what the cleaner moves is stored at rest at once: after
/// overwrites leave extents half dead and a cleaner pass moves them, the recompressor
/// takes none of the moved blocks again (it used to move every one of them a second
/// time). Everything reads back and `check` is clean.
#[test]
fn the_cleaner_settles_what_it_moves() {
    let (mut d, dev, vol) = rest_volume_with(2048, 53, 6, 64 << 10);
    // The first half of every other extent overwritten with new data, block by block.
    for unit in (0..2048 / 16).step_by(2) {
        for k in 0..8 {
            let lba = unit * 16 + k;
            let fresh = data(1, 10_000 + lba as u64);
            vol.write((lba * B) as u64, &fresh, false).expect("overwrite");
            d[lba * B..(lba + 1) * B].copy_from_slice(&fresh);
        }
    }
    vol.flush().expect("flush");
    let r = vol.clean(&CleanOptions { budget_bytes: u64::MAX, live_max: B as u32 }).expect("clean");
    eprintln!("{r:?}");
    assert!(r.fragments_moved > 0 && r.blocks_remapped >= 256, "the half-dead extents moved: {r:?}");
    vol.flush().expect("flush");
    let (_, _, _, bytes) = recompress_all(&vol, 4 << 20);
    let left = (2048 - r.blocks_remapped) * B as u64;
    assert!(bytes <= left, "the recompressor took moved blocks again: {bytes} bytes, at most {left} were not moved");
    read_back(&vol, &d);
    close_and_check(dev, vol);
}
