//! Damaged metadata surfaces as a typed `Error::Corruption` naming the structure and its
//! address, not as a message to parse.
//!
//! Regression: a block map page or a journal block whose checksum holds but whose map entry
//! carries an unknown state was reported as `Error::Corrupt(String)` ("invalid block map
//! entry state 3"), which callers could only tell apart by its text. Each structure is
//! damaged here the way only a bug or a bad device can damage it (the checksum is resealed
//! over the bad bytes, so the structure is not merely torn) and the error must name it.
mod common;
use common::*;
use dedupvol_core::format::{
    Superblock, JOURNAL_ENTRY_BYTES, JOURNAL_HEADER_BYTES, JOURNAL_MAGIC, MAP_ENTRY_BYTES, PAGE_HEADER_BYTES,
};
use dedupvol_core::{Corruption, Error, Geometry, MemStorage, Storage, Volume};
use std::sync::Arc;

const BLOCK: usize = 4096;
/// Offset of the crc field of a block map page (docs/format.md, "Block map pages").
const PAGE_CRC_OFFSET: usize = 4;
/// Offset of the crc field of a journal block (docs/format.md, "Journal").
const JOURNAL_CRC_OFFSET: usize = 8;
/// A map entry state no version of the format has defined.
const UNKNOWN_STATE: u8 = 7;
/// The logical block the tests write and damage.
const LBA: u64 = 5;

fn geometry(dev: &MemStorage) -> Geometry {
    let mut sb = vec![0u8; BLOCK];
    dev.read_at(&mut sb, 0).expect("read superblock");
    Superblock::decode(&sb, 0).expect("decode").expect("superblock").geometry
}

fn read_block(dev: &MemStorage, block: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    dev.read_at(&mut b, block * BLOCK as u64).expect("read block");
    b
}

/// Writes `b` back with its crc (at `crc_offset`) recomputed over the damaged bytes.
fn reseal_and_write(dev: &MemStorage, block: u64, mut b: Vec<u8>, crc_offset: usize) {
    b.get_mut(crc_offset..crc_offset + 4).expect("crc inside the block").fill(0);
    let crc = crc32c::crc32c(&b);
    b.get_mut(crc_offset..crc_offset + 4).expect("crc inside the block").copy_from_slice(&crc.to_le_bytes());
    dev.write_at(&b, block * BLOCK as u64).expect("write block");
}

fn corruption(r: Result<impl Sized, Error>) -> Corruption {
    match r {
        Err(Error::Corruption(c)) => c,
        Err(e) => panic!("expected Error::Corruption, got {e:?}"),
        Ok(_) => panic!("expected Error::Corruption, got success"),
    }
}

#[test]
fn a_block_map_page_with_an_unknown_entry_state_is_corruption_of_that_page() {
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |_| {});
    vol.write(LBA * BLOCK as u64, &block(LBA, 1), false).expect("write");
    vol.close().expect("close");
    let geo = geometry(&dev);
    // Both slots of page 0: whichever holds the newest copy, it holds the bad entry.
    let state_at = PAGE_HEADER_BYTES + LBA as usize * MAP_ENTRY_BYTES + 5;
    let mut damaged = 0;
    for slot in 0..2 {
        let at = geo.block_map_start + slot;
        let mut b = read_block(&dev, at);
        if &b[..4] != b"DVBM" {
            continue;
        }
        assert_eq!(b[state_at], 2, "lba {LBA} should be stored raw (random data)");
        b[state_at] = UNKNOWN_STATE;
        reseal_and_write(&dev, at, b, PAGE_CRC_OFFSET);
        damaged += 1;
    }
    assert!(damaged > 0, "the clean close wrote no copy of block map page 0");

    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("open");
    let mut out = vec![0u8; BLOCK];
    let c = corruption(vol.read(LBA * BLOCK as u64, &mut out));
    assert_eq!((c.structure, c.address), ("block map page", 0), "{c}");
    assert!(c.found.contains(&format!("logical block {LBA}")) && c.found.contains("state 7"), "{c}");
    // A neighbour on the same page decodes: the error is about one entry, not the page.
    vol.read(0, &mut out).expect("lba 0 on the same page");
    assert_eq!(out, vec![0u8; BLOCK]);
    let e = vol.read(LBA * BLOCK as u64, &mut out).expect_err("still damaged");
    assert_eq!(e.errno(), libc::EIO, "corruption is reported as EIO");
    // An allocation query over the damaged entry fails the same way (the NBD server
    // answers it with an error chunk); one that stops short of it still answers.
    let c = corruption(vol.block_status(0, 8 * BLOCK as u64, 16));
    assert_eq!((c.structure, c.address), ("block map page", 0), "{c}");
    let before = vol.block_status(0, LBA * BLOCK as u64, 16).expect("lbas before the damaged one");
    assert_eq!(before.iter().map(|e| e.len).sum::<u64>(), LBA * BLOCK as u64);
    drop(vol);
}

#[test]
fn a_journal_block_with_an_unknown_entry_state_is_corruption_of_that_block() {
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |o| o.journal_size_bytes = Some(256 << 10));
    vol.write(LBA * BLOCK as u64, &block(LBA, 1), false).expect("write");
    vol.flush().expect("flush");
    // Dropped without a close: the open must replay the journal block just committed.
    drop(vol);
    let geo = geometry(&dev);
    let mut damaged = None;
    for p in 0..geo.journal_blocks {
        let at = geo.journal_start + p;
        let mut b = read_block(&dev, at);
        if b[..8] != JOURNAL_MAGIC {
            continue;
        }
        let first_lba = u64::from_le_bytes(b[JOURNAL_HEADER_BYTES..JOURNAL_HEADER_BYTES + 8].try_into().expect("8"));
        if first_lba != LBA {
            continue;
        }
        let block_seq = u64::from_le_bytes(b[32..40].try_into().expect("8"));
        // Entry 0's new mapping: lba (8 bytes), then the 16-byte entry whose byte 5 is the state.
        b[JOURNAL_HEADER_BYTES + 8 + 5] = UNKNOWN_STATE;
        reseal_and_write(&dev, at, b, JOURNAL_CRC_OFFSET);
        damaged = Some(block_seq);
        break;
    }
    let block_seq = damaged.expect("no journal block records the write");
    const _: () = assert!(JOURNAL_HEADER_BYTES + JOURNAL_ENTRY_BYTES <= BLOCK);

    let c = corruption(Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()));
    assert_eq!((c.structure, c.address), ("journal block", block_seq), "{c}");
    assert!(c.found.contains("entry 0 (new mapping)") && c.found.contains("state 7"), "{c}");
    let text = Error::Corruption(c).to_string();
    assert!(text.contains("corruption detected") && text.contains("journal block"), "{text}");
}

#[test]
fn both_superblock_copies_damaged_is_corruption_naming_each_copy() {
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |_| {});
    vol.close().expect("close");
    // Bytes inside the checksummed block but past the fields decode reads first.
    for copy in 0..2u64 {
        dev.write_at(&[0xAB; 4], copy * BLOCK as u64 + 100).expect("damage");
    }
    let c = corruption(Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()));
    assert_eq!(c.structure, "superblock copy", "{c}");
    assert!(c.found.contains("copy 0 holds") && c.found.contains("copy 1 holds"), "{c}");
    assert!(c.found.contains("checksum mismatch"), "{c}");
}
