//! Regression tests: `format` destroyed what it was not asked to.
//!
//! - It overwrote anything that was not a dedupvol volume without `--force`:
//!   `mkfs.ext4 -q -F ext.img; dedupvol format ext.img --logical-size 64M` exited 0 and
//!   `blkid` found nothing; a plain non-empty data file was overwritten the same way.
//! - A failed format left or grew files: `--physical-size 0` left a 0-byte file, a
//!   too-small logical size grew the file and then failed.
//! - `--physical-size` was silently ignored on a block device.
use std::process::Command;

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn format_refuses_a_file_system_and_plain_data_without_force() {
    let dir = tempfile::tempdir().expect("tmp");
    let ext = dir.path().join("ext.img");
    let e = ext.to_str().expect("utf8");
    let mkfs = Command::new("mkfs.ext4").args(["-q", "-F", e, "64M"]).output();
    match mkfs {
        Ok(o) if o.status.success() => {
            let before = std::fs::read(&ext).expect("read");
            let o = dedupvol(&["format", e, "--logical-size", "64M"]);
            assert_eq!(o.status.code(), Some(1), "{}", text(&o));
            assert!(text(&o).contains("ext2/3/4 file system") && text(&o).contains("--force"), "{}", text(&o));
            assert!(std::fs::read(&ext).expect("read") == before, "the file system was touched");
            let o = dedupvol(&["format", e, "--logical-size", "64M", "--force"]);
            assert!(o.status.success(), "{}", text(&o));
        }
        _ => eprintln!("SKIPPED the ext4 case: mkfs.ext4 is not installed (scripts/apt-packages.txt installs it)"),
    }
    // Hand-made signatures of other kinds.
    for (name, off, magic, want) in [
        ("xfs", 0usize, &b"XFSB"[..], "XFS"),
        ("swap", 4086, &b"SWAPSPACE2"[..], "swap"),
        ("gpt", 512, &b"EFI PART"[..], "GPT"),
        ("luks", 0, &b"LUKS\xba\xbe"[..], "LUKS"),
    ] {
        let p = dir.path().join(name);
        let mut img = vec![0u8; 8 << 20];
        img[off..off + magic.len()].copy_from_slice(magic);
        std::fs::write(&p, &img).expect("write");
        let o = dedupvol(&["format", p.to_str().expect("utf8"), "--logical-size", "8M"]);
        assert!(!o.status.success() && text(&o).contains(want), "{name}: {}", text(&o));
        assert!(std::fs::read(&p).expect("read") == img, "{name} was touched");
    }
    // Plain data, even only at the end of the file.
    let data = dir.path().join("data.bin");
    let mut img = vec![0u8; 16 << 20];
    *img.last_mut().expect("len") = 1;
    std::fs::write(&data, &img).expect("write");
    let o = dedupvol(&["format", data.to_str().expect("utf8"), "--logical-size", "8M"]);
    assert!(!o.status.success() && text(&o).contains("holds data"), "{}", text(&o));
    // An all-zero file is fair game.
    std::fs::write(&data, vec![0u8; 16 << 20]).expect("write");
    let o = dedupvol(&["format", data.to_str().expect("utf8"), "--logical-size", "8M"]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_failed_format_leaves_no_file_and_grows_none() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = dir.path().join("v.img");
    let s = p.to_str().expect("utf8");
    let o = dedupvol(&["format", s, "--logical-size", "64M", "--physical-size", "0"]);
    assert!(!o.status.success() && text(&o).contains("larger than zero"), "{}", text(&o));
    assert!(!p.exists(), "--physical-size 0 left a file");
    let o = dedupvol(&["format", s, "--logical-size", "1K", "--physical-size", "64M"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(!p.exists(), "a failed format left a new file");
    std::fs::write(&p, vec![0u8; 4096]).expect("small file");
    let o = dedupvol(&["format", s, "--logical-size", "1K", "--physical-size", "64M"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::metadata(&p).expect("meta").len(), 4096, "a failed format grew the file");
    let o = dedupvol(&["format", dir.path().to_str().expect("utf8"), "--logical-size", "64M"]);
    assert!(!o.status.success() && text(&o).contains("is a directory"), "{}", text(&o));
}

#[test]
fn physical_size_on_a_block_device_must_match_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let backing = dir.path().join("loop.img");
    std::fs::write(&backing, vec![0u8; 32 << 20]).expect("backing");
    let out = Command::new("losetup").args(["--find", "--show"]).arg(&backing).output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            eprintln!("SKIPPED: no loop device could be set up here (needs root and losetup)");
            return;
        }
    };
    let o = dedupvol(&["format", &dev, "--logical-size", "64M", "--physical-size", "64M"]);
    let t = text(&o);
    let _ = Command::new("losetup").args(["-d", &dev]).status();
    assert!(!o.status.success() && t.contains("block device of 33554432 bytes"), "{t}");
}
