//! What a device or file holds before `format` overwrites it: known signatures (file
//! systems, volume managers, partition tables, swap), or just data.
//!
//! Invariants:
//! - Only reads, never writes; a missing or empty target holds nothing.
//! - A dedupvol volume is reported as `None` here: the engine refuses it by itself
//!   (`--force` to overwrite), with its own message.

use anyhow::Context;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes probed at the start and at the end of the target.
const PROBE_BYTES: u64 = 1 << 20;

/// (offset, magic, name) of the signatures recognised at the start of a device.
const SIGNATURES: &[(u64, &[u8], &str)] = &[
    (1080, &[0x53, 0xEF], "an ext2/3/4 file system"),
    (0, b"XFSB", "an XFS file system"),
    (65600, b"_BHRfS_M", "a btrfs file system"),
    (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
    (512, b"LABELONE", "an LVM physical volume"),
    (512, b"EFI PART", "a GPT partition table"),
    (4086, b"SWAPSPACE2", "swap space"),
    (4086, b"SWAP-SPACE", "swap space"),
    (0x8001, b"CD001", "an ISO 9660 image"),
    (0, b"QFI\xfb", "a qcow2 image"),
    (3, b"NTFS    ", "an NTFS file system"),
    (0x36, b"FAT", "a FAT file system"),
    (0x52, b"FAT32   ", "a FAT32 file system"),
];

/// What `path` holds that formatting would destroy: a named signature, "holds data", or
/// None (missing, empty, all zeros, or a dedupvol volume).
pub fn foreign_content(path: &Path) -> anyhow::Result<Option<String>> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    let len = device_len(&f, path)?;
    if len == 0 {
        return Ok(None);
    }
    let head = read_at(&f, 0, PROBE_BYTES.min(len), path)?;
    if head.starts_with(&dedupvol_core::format::SUPERBLOCK_MAGIC) {
        return Ok(None);
    }
    for &(off, magic, name) in SIGNATURES {
        let at = off as usize;
        if head.get(at..at + magic.len()) == Some(magic) {
            return Ok(Some(format!("holds {name}")));
        }
    }
    if head.get(510..512) == Some(&[0x55, 0xAA]) {
        return Ok(Some("holds an MBR partition table or boot sector".into()));
    }
    let tail_start = len.saturating_sub(PROBE_BYTES).max(head.len() as u64);
    let tail = read_at(&f, tail_start, len - tail_start, path)?;
    if head.iter().chain(tail.iter()).any(|&b| b != 0) {
        return Ok(Some("holds data (it is not all zeros and not a dedupvol volume)".into()));
    }
    Ok(None)
}

/// Size in bytes of an open file or block device (a device's metadata says 0).
pub fn device_len(f: &File, name: &Path) -> anyhow::Result<u64> {
    use std::io::Seek;
    let mut g = f;
    g.seek(std::io::SeekFrom::End(0)).with_context(|| format!("measuring {}", name.display()))
}

fn read_at(f: &File, offset: u64, len: u64, path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    let mut done = 0;
    while done < buf.len() {
        let n =
            f.read_at(&mut buf[done..], offset + done as u64).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        done += n;
    }
    buf.truncate(done);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_it_finds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("x");
        assert_eq!(foreign_content(&p).expect("missing"), None);
        std::fs::write(&p, vec![0u8; 3 << 20]).expect("zeros");
        assert_eq!(foreign_content(&p).expect("zeros"), None);
        let mut ext = vec![0u8; 1 << 20];
        ext[1080] = 0x53;
        ext[1081] = 0xEF;
        std::fs::write(&p, &ext).expect("ext");
        assert!(foreign_content(&p).expect("ext").is_some_and(|s| s.contains("ext2/3/4")));
        let mut tail = vec![0u8; 3 << 20];
        tail[(3 << 20) - 1] = 1;
        std::fs::write(&p, &tail).expect("tail");
        assert!(foreign_content(&p).expect("tail").is_some_and(|s| s.contains("holds data")));
    }
}
