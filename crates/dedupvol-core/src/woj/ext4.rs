//! Journal discovery: where the journal of an ext3/ext4 file system on the volume lives.
//!
//! Steps (`discover`):
//! 1. read the volume's first 4 KiB: an ext superblock at byte 1024 means a file system on
//!    the whole volume; else an MBR (0x55AA) lists up to four primary partitions, and a
//!    protective MBR (type 0xEE) sends us to the GPT header at byte 512 and its entries;
//! 2. for each candidate start, the ext superblock at start + 1024 (magic 0xEF53): block
//!    size, inodes per group, descriptor size, the journal inode number, or the
//!    `journal_dev` feature (the whole device is an external journal);
//! 3. the journal inode: its group's descriptor gives the inode table; the inode's
//!    `i_block` holds an extent tree (ext4) or block pointers (ext3: direct, single and
//!    double indirect); the leaves are the journal's physical blocks.
//!
//! Everything read is untrusted (the client writes it): every count, depth and offset is
//! bounded, and anything that does not parse is reported as a note and ignored. A wrong
//! answer costs only missed sharing, never data: a share is made only after the journal
//! copy's bytes were compared with the checkpoint write (see `woj`).
//!
//! Invariants:
//! - At most `READS_MAX` reads of at most 4 KiB per discovery, and at most `RANGES_MAX`
//!   ranges; every range lies inside the volume.
//! - No panic on any input (the fuzz-like test feeds random bytes).

/// The ext2/3/4 superblock magic.
const EXT_MAGIC: u16 = 0xEF53;
/// `s_feature_compat`: the file system has a journal.
const COMPAT_HAS_JOURNAL: u32 = 0x4;
/// `s_feature_incompat`: this is an external journal device.
const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
/// `s_feature_incompat`: 64-bit block numbers (descriptor size from `s_desc_size`).
const INCOMPAT_64BIT: u32 = 0x80;
/// `i_flags`: the inode's blocks are an extent tree.
const EXTENTS_FL: u32 = 0x80000;
/// Extent tree node header magic.
const EXTENT_MAGIC: u16 = 0xF30A;
/// jbd2 block header magic (big-endian on disk).
pub(crate) const JBD2_MAGIC: u32 = 0xC03B_3998;

/// Device reads one discovery may make.
const READS_MAX: usize = 256;
/// Journal ranges kept (after merging contiguous ones).
pub(crate) const RANGES_MAX: usize = 1024;
/// Extent tree depth followed (ext4 allows 5).
const EXTENT_DEPTH_MAX: u16 = 5;
/// Partitions examined.
const PARTITIONS_MAX: usize = 128;

/// A byte range of the volume holding a journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalRange {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What discovery found.
#[derive(Debug, Clone, Default)]
pub(crate) struct Found {
    /// Journal ranges, in volume bytes.
    pub(crate) ranges: Vec<JournalRange>,
    /// Logical blocks (4 KiB) whose rewrite means the file systems should be looked at
    /// again: the partition table and every ext superblock location examined.
    pub(crate) watch: Vec<u64>,
    /// What was found or why nothing was, for `stats`.
    pub(crate) notes: Vec<String>,
}

/// Reads volume bytes for discovery; an error or a short volume is an unreadable spot.
pub(crate) trait Reader {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> bool;
}

struct Bounded<'a> {
    inner: &'a mut dyn Reader,
    size: u64,
    reads: usize,
}

impl Bounded<'_> {
    fn read(&mut self, offset: u64, len: usize) -> Option<Vec<u8>> {
        if self.reads >= READS_MAX || offset.checked_add(len as u64).is_none_or(|e| e > self.size) {
            return None;
        }
        self.reads += 1;
        let mut b = vec![0u8; len];
        self.inner.read(offset, &mut b).then_some(b)
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2).and_then(|s| s.try_into().ok()).map_or(0, u16::from_le_bytes)
}
fn le32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).and_then(|s| s.try_into().ok()).map_or(0, u32::from_le_bytes)
}
fn le64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).and_then(|s| s.try_into().ok()).map_or(0, u64::from_le_bytes)
}

/// True when a 4 KiB block written into a journal is jbd2's own metadata (descriptor,
/// commit, journal superblock or revoke block): jbd2 escapes data blocks that begin with
/// its magic, so a journal block with the magic and a known type is never file data.
pub(crate) fn is_jbd2_meta(block: &[u8]) -> bool {
    let be = |at: usize| block.get(at..at + 4).and_then(|s| s.try_into().ok()).map_or(0, u32::from_be_bytes);
    be(0) == JBD2_MAGIC && (1..=5).contains(&be(4))
}

/// Finds the journals of the ext3/ext4 file systems on a volume of `size` bytes.
pub(crate) fn discover(reader: &mut dyn Reader, size: u64) -> Found {
    let mut r = Bounded { inner: reader, size, reads: 0 };
    let mut found = Found { watch: vec![0], ..Found::default() };
    let Some(head) = r.read(0, 4096) else {
        found.notes.push("the volume's first block could not be read".into());
        return found;
    };
    if le16(&head, 1024 + 0x38) == EXT_MAGIC {
        ext_fs(&mut r, 0, size, &mut found);
        return finish(found, size);
    }
    let mut starts: Vec<(u64, u64)> = Vec::new();
    if le16(&head, 510) == 0xAA55 {
        let protective = (0..4).any(|i| head.get(446 + 16 * i + 4) == Some(&0xEE));
        if protective {
            gpt(&mut r, &head, &mut starts, &mut found);
        } else {
            for i in 0..4 {
                let e = 446 + 16 * i;
                let (kind, lba, count) =
                    (head.get(e + 4).copied().unwrap_or(0), le32(&head, e + 8), le32(&head, e + 12));
                if kind != 0 && count > 0 {
                    starts.push((u64::from(lba) * 512, u64::from(count) * 512));
                }
            }
        }
    }
    if starts.is_empty() {
        found.notes.push("no ext3/ext4 file system or partition table found".into());
    }
    for (start, len) in starts {
        let len = len.min(size.saturating_sub(start));
        if len > 2048 {
            found.watch.push((start + 1024) / 4096);
            if r.read(start + 1024, 1024).is_some_and(|sb| le16(&sb, 0x38) == EXT_MAGIC) {
                ext_fs(&mut r, start, len, &mut found);
            }
        }
    }
    finish(found, size)
}

/// GPT: the header at byte 512, then up to `PARTITIONS_MAX` entries.
fn gpt(r: &mut Bounded, head: &[u8], starts: &mut Vec<(u64, u64)>, found: &mut Found) {
    let h = head.get(512..1024).unwrap_or(&[]);
    if h.get(0..8) != Some(b"EFI PART".as_slice()) {
        found.notes.push("protective MBR without a GPT header".into());
        return;
    }
    let (entries_lba, count, entry_size) = (le64(h, 72), le32(h, 80) as usize, le32(h, 84) as usize);
    if !(128..=4096).contains(&entry_size) || entries_lba == 0 {
        found.notes.push(format!("GPT header with entry size {entry_size} ignored"));
        return;
    }
    let count = count.min(PARTITIONS_MAX);
    let Some(at) = entries_lba.checked_mul(512) else { return };
    let Some(table) = r.read(at, count * entry_size) else {
        found.notes.push("GPT partition entries unreadable".into());
        return;
    };
    found.watch.extend((at / 4096)..=((at + (count * entry_size) as u64).saturating_sub(1) / 4096));
    for i in 0..count {
        let e = table.get(i * entry_size..(i + 1) * entry_size).unwrap_or(&[]);
        let (first, last) = (le64(e, 32), le64(e, 40));
        if e.get(0..16).is_some_and(|t| t.iter().any(|b| *b != 0)) && first > 0 && last >= first {
            if let (Some(s), Some(n)) = (first.checked_mul(512), (last - first + 1).checked_mul(512)) {
                starts.push((s, n));
            }
        }
    }
}

/// One ext file system starting at byte `start`, `len` bytes long.
fn ext_fs(r: &mut Bounded, start: u64, len: u64, found: &mut Found) {
    let Some(sb) = r.read(start + 1024, 1024) else { return };
    let log = le32(&sb, 0x18);
    if log > 6 {
        found.notes.push(format!("ext superblock at {start}: block size 2^(10+{log}) ignored"));
        return;
    }
    let bs = 1024u64 << log;
    let blocks = u64::from(le32(&sb, 0x4)) | (u64::from(le32(&sb, 0x150)) << 32);
    let incompat = le32(&sb, 0x60);
    if incompat & INCOMPAT_JOURNAL_DEV != 0 {
        // An external journal device: everything after the block holding the superblock.
        let first = (2048u64).div_ceil(bs) * bs;
        let end = blocks.saturating_mul(bs).min(len);
        if end > first {
            found.ranges.push(JournalRange { offset: start + first, len: end - first });
            found.notes.push(format!("external jbd2 journal device at byte {start}, {} bytes", end - first));
        }
        return;
    }
    if le32(&sb, 0x5C) & COMPAT_HAS_JOURNAL == 0 {
        found.notes.push(format!("ext file system at byte {start} has no journal"));
        return;
    }
    let inum = le32(&sb, 0xE0);
    if inum == 0 {
        found
            .notes
            .push(format!("ext file system at byte {start} uses an external journal (give it with OFFSET:LENGTH)"));
        return;
    }
    let ipg = le32(&sb, 0x28);
    let inode_size = if le32(&sb, 0x4C) == 0 { 128 } else { u64::from(le16(&sb, 0x58)) };
    let desc_size = if incompat & INCOMPAT_64BIT != 0 { u64::from(le16(&sb, 0xFE)) } else { 32 };
    if ipg == 0 || !(128..=bs).contains(&inode_size) || !(32..=1024).contains(&desc_size) {
        found.notes.push(format!("ext superblock at byte {start}: inconsistent geometry ignored"));
        return;
    }
    let fs = Fs { start, bs, len };
    let group = u64::from((inum - 1) / ipg);
    let index = u64::from((inum - 1) % ipg);
    // Group descriptors follow the block holding the superblock.
    let gdt = u64::from(le32(&sb, 0x14)) + 1;
    let Some(desc) = fs.read_at(r, gdt * bs + group * desc_size, desc_size as usize) else {
        found.notes.push(format!("ext file system at byte {start}: group descriptor unreadable"));
        return;
    };
    let itable = u64::from(le32(&desc, 0x8)) | if desc_size >= 64 { u64::from(le32(&desc, 0x28)) << 32 } else { 0 };
    let Some(inode) = itable.checked_mul(bs).and_then(|b| fs.read_at(r, b + index * inode_size, 128)) else {
        found.notes.push(format!("ext file system at byte {start}: journal inode unreadable"));
        return;
    };
    let size = u64::from(le32(&inode, 0x4)) | (u64::from(le32(&inode, 0x6C)) << 32);
    let want = size.div_ceil(bs);
    let iblock = inode.get(0x28..0x28 + 60).unwrap_or(&[]).to_vec();
    let mut extents: Vec<(u64, u64)> = Vec::new();
    let ok = if le32(&inode, 0x20) & EXTENTS_FL != 0 {
        extent_node(r, &fs, &iblock, EXTENT_DEPTH_MAX, &mut extents)
    } else {
        indirect(r, &fs, &iblock, want, &mut extents)
    };
    if !ok {
        found.notes.push(format!("ext file system at byte {start}: journal inode {inum} block map does not parse"));
        return;
    }
    let mut total = 0u64;
    for (pblk, n) in extents {
        let n = n.min(want.saturating_sub(total));
        if n == 0 {
            break;
        }
        total += n;
        if let (Some(off), Some(l)) = (pblk.checked_mul(bs), n.checked_mul(bs)) {
            if off.checked_add(l).is_some_and(|e| e <= len) {
                found.ranges.push(JournalRange { offset: start + off, len: l });
            }
        }
    }
    found.notes.push(format!(
        "ext file system at byte {start}: block size {bs}, journal inode {inum}, {} journal bytes found",
        total * bs
    ));
}

struct Fs {
    start: u64,
    bs: u64,
    len: u64,
}

impl Fs {
    fn read_at(&self, r: &mut Bounded, off: u64, n: usize) -> Option<Vec<u8>> {
        if off.checked_add(n as u64)? > self.len {
            return None;
        }
        r.read(self.start + off, n)
    }
    fn block(&self, r: &mut Bounded, pblk: u64) -> Option<Vec<u8>> {
        self.read_at(r, pblk.checked_mul(self.bs)?, self.bs as usize)
    }
}

/// An extent tree node (the inode's `i_block`, or a tree block): appends its leaves'
/// (physical block, count) in logical order. False when it does not parse.
fn extent_node(r: &mut Bounded, fs: &Fs, node: &[u8], depth_left: u16, out: &mut Vec<(u64, u64)>) -> bool {
    if le16(node, 0) != EXTENT_MAGIC {
        return false;
    }
    let (entries, depth) = (le16(node, 2) as usize, le16(node, 6));
    if depth > depth_left || entries > (node.len().saturating_sub(12)) / 12 {
        return false;
    }
    for i in 0..entries {
        let e = 12 + 12 * i;
        if out.len() >= RANGES_MAX {
            return true;
        }
        if depth == 0 {
            let raw_len = u64::from(le16(node, e + 4));
            // Past 32768 the extent is unwritten (preallocated), its length less 32768.
            let n = if raw_len > 32768 { raw_len - 32768 } else { raw_len };
            let pblk = (u64::from(le16(node, e + 6)) << 32) | u64::from(le32(node, e + 8));
            out.push((pblk, n));
        } else {
            let child = (u64::from(le16(node, e + 8)) << 32) | u64::from(le32(node, e + 4));
            let Some(b) = fs.block(r, child) else { return false };
            if !extent_node(r, fs, &b, depth - 1, out) {
                return false;
            }
        }
    }
    true
}

/// ext3's block pointers: 12 direct, one single and one double indirect block (a journal
/// needing the triple indirect block is larger than `READS_MAX` lets us follow anyway).
fn indirect(r: &mut Bounded, fs: &Fs, iblock: &[u8], want: u64, out: &mut Vec<(u64, u64)>) -> bool {
    let push = |out: &mut Vec<(u64, u64)>, p: u32| {
        if p == 0 {
            return;
        }
        let p = u64::from(p);
        if let Some((s, n)) = out.last_mut() {
            if *s + *n == p {
                *n += 1;
                return;
            }
        }
        if out.len() < RANGES_MAX {
            out.push((p, 1));
        }
    };
    let count = |out: &Vec<(u64, u64)>| out.iter().map(|(_, n)| n).sum::<u64>();
    for i in 0..12 {
        push(out, le32(iblock, 4 * i));
    }
    let per = (fs.bs / 4) as usize;
    let ind = le32(iblock, 48);
    if ind != 0 && count(out) < want {
        let Some(b) = fs.block(r, u64::from(ind)) else { return false };
        (0..per).for_each(|i| push(out, le32(&b, 4 * i)));
    }
    let dind = le32(iblock, 52);
    if dind != 0 && count(out) < want {
        let Some(d) = fs.block(r, u64::from(dind)) else { return false };
        for k in 0..per {
            let p = le32(&d, 4 * k);
            if p == 0 || count(out) >= want {
                break;
            }
            let Some(b) = fs.block(r, u64::from(p)) else { return false };
            (0..per).for_each(|i| push(out, le32(&b, 4 * i)));
        }
    }
    true
}

/// Sorts and merges the ranges, drops those outside the volume and keeps `RANGES_MAX`.
fn finish(mut found: Found, size: u64) -> Found {
    found.ranges.retain(|r| r.len > 0 && r.offset.checked_add(r.len).is_some_and(|e| e <= size));
    found.ranges.sort_by_key(|r| r.offset);
    let mut merged: Vec<JournalRange> = Vec::with_capacity(found.ranges.len());
    for r in found.ranges.drain(..) {
        match merged.last_mut() {
            Some(m) if r.offset <= m.offset + m.len => m.len = m.len.max(r.offset + r.len - m.offset),
            _ => merged.push(r),
        }
    }
    merged.truncate(RANGES_MAX);
    found.ranges = merged;
    found.watch.sort_unstable();
    found.watch.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    struct Mem(Vec<u8>);
    impl Reader for Mem {
        fn read(&mut self, offset: u64, buf: &mut [u8]) -> bool {
            match self.0.get(offset as usize..offset as usize + buf.len()) {
                Some(s) => {
                    buf.copy_from_slice(s);
                    true
                }
                None => false,
            }
        }
    }

    fn put16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// A minimal ext4 image at `start`: 4 KiB blocks, journal inode 8 in group 0 whose
    /// inode table is block 5, an extent tree of depth 1 (a tree block at block 6) with
    /// two extents: blocks 100..108 and 200..204.
    fn tiny_ext4(img: &mut [u8], start: usize) {
        let sb = start + 1024;
        put32(img, sb + 0x4, 1024);
        put32(img, sb + 0x18, 2);
        put32(img, sb + 0x28, 64);
        put16(img, sb + 0x38, EXT_MAGIC);
        put32(img, sb + 0x4C, 1);
        put16(img, sb + 0x58, 256);
        put32(img, sb + 0x5C, COMPAT_HAS_JOURNAL);
        put32(img, sb + 0xE0, 8);
        put32(img, start + 4096 + 0x8, 5);
        let ino = start + 5 * 4096 + 7 * 256;
        put32(img, ino + 0x4, 12 * 4096);
        put32(img, ino + 0x20, EXTENTS_FL);
        let root = ino + 0x28;
        put16(img, root, EXTENT_MAGIC);
        put16(img, root + 2, 1);
        put16(img, root + 4, 4);
        put16(img, root + 6, 1);
        put32(img, root + 12 + 4, 6);
        let leaf = start + 6 * 4096;
        put16(img, leaf, EXTENT_MAGIC);
        put16(img, leaf + 2, 2);
        put16(img, leaf + 4, 340);
        put32(img, leaf + 12, 0);
        put16(img, leaf + 12 + 4, 8);
        put32(img, leaf + 12 + 8, 100);
        put32(img, leaf + 24, 8);
        put16(img, leaf + 24 + 4, 4);
        put32(img, leaf + 24 + 8, 200);
    }

    #[test]
    fn finds_the_journal_extents_of_a_whole_volume_file_system() {
        let mut img = vec![0u8; 4 << 20];
        tiny_ext4(&mut img, 0);
        let size = img.len() as u64;
        let f = discover(&mut Mem(img), size);
        assert_eq!(
            f.ranges,
            vec![
                JournalRange { offset: 100 * 4096, len: 8 * 4096 },
                JournalRange { offset: 200 * 4096, len: 4 * 4096 }
            ],
            "{:?}",
            f.notes
        );
    }

    #[test]
    fn finds_a_file_system_inside_an_mbr_partition() {
        let mut img = vec![0u8; 8 << 20];
        let start = 1 << 20;
        tiny_ext4(&mut img, start);
        img[510] = 0x55;
        img[511] = 0xAA;
        img[446 + 4] = 0x83;
        put32(&mut img, 446 + 8, (start / 512) as u32);
        put32(&mut img, 446 + 12, ((4 << 20) / 512) as u32);
        let size = img.len() as u64;
        let f = discover(&mut Mem(img), size);
        assert_eq!(f.ranges.first(), Some(&JournalRange { offset: start as u64 + 100 * 4096, len: 8 * 4096 }));
        assert!(f.watch.contains(&((start as u64 + 1024) / 4096)));
    }

    #[test]
    fn finds_a_file_system_inside_a_gpt_partition() {
        let mut img = vec![0u8; 8 << 20];
        let start = 1 << 20;
        tiny_ext4(&mut img, start);
        img[510] = 0x55;
        img[511] = 0xAA;
        img[446 + 4] = 0xEE;
        img[512..520].copy_from_slice(b"EFI PART");
        img[512 + 72..512 + 80].copy_from_slice(&2u64.to_le_bytes());
        put32(&mut img, 512 + 80, 128);
        put32(&mut img, 512 + 84, 128);
        let e = 1024;
        img[e] = 1; // a non-zero type GUID
        img[e + 32..e + 40].copy_from_slice(&((start / 512) as u64).to_le_bytes());
        img[e + 40..e + 48].copy_from_slice(&(((start + (4 << 20)) / 512 - 1) as u64).to_le_bytes());
        let size = img.len() as u64;
        let f = discover(&mut Mem(img), size);
        assert_eq!(f.ranges.len(), 2, "{:?}", f.notes);
    }

    #[test]
    fn jbd2_metadata_blocks_are_recognised() {
        let mut b = vec![0u8; 4096];
        b[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
        for t in 1..=5u32 {
            b[4..8].copy_from_slice(&t.to_be_bytes());
            assert!(is_jbd2_meta(&b));
        }
        b[4..8].copy_from_slice(&9u32.to_be_bytes());
        assert!(!is_jbd2_meta(&b));
    }

    /// Hostile input: random bytes over a valid image's structures never panic, never
    /// read more than `READS_MAX` times, and every range found lies inside the volume.
    #[test]
    fn garbage_never_panics() {
        for seed in 0..300u64 {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut img = vec![0u8; 2 << 20];
            tiny_ext4(&mut img, 0);
            for _ in 0..r.gen_range(1..64) {
                let at = if r.gen_bool(0.5) { r.gen_range(1024..1400) } else { r.gen_range(0..img.len()) };
                img[at] = r.gen();
            }
            if seed % 7 == 0 {
                img[..8192].iter_mut().for_each(|b| *b = r.gen());
                put16(&mut img, 1024 + 0x38, EXT_MAGIC);
            }
            let size = img.len() as u64;
            let f = discover(&mut Mem(img), size);
            assert!(f.ranges.iter().all(|x| x.offset + x.len <= size), "seed {seed}");
            assert!(f.ranges.len() <= RANGES_MAX);
        }
    }
}
