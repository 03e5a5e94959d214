//! The volume commands end to end through the real binary: format (and its refusals),
//! import/export round trip, stats --json fields, check on a clean volume, check finding a
//! corrupted data block (exit 4, the affected logical block named), and check --repair
//! restoring reference counts after a refcount page is destroyed.
use std::os::unix::fs::FileExt;
use std::process::Command;

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn bad_input_gets_clear_errors() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = dir.path().join("v.img");
    let p = img.to_str().expect("utf8");
    let o = dedupvol(&["format", p, "--logical-size", "1G", "--physical-size", "64K"]);
    assert!(!o.status.success() && text(&o).contains("too small"), "{}", text(&o));
    let o = dedupvol(&["format", p, "--logical-size", "12X", "--physical-size", "64M"]);
    assert!(!o.status.success() && text(&o).contains("size"), "{}", text(&o));
    let o = dedupvol(&["format", p, "--logical-size", "1G", "--physical-size", "64M", "--compression", "gzip"]);
    assert!(!o.status.success() && text(&o).contains("compression"), "{}", text(&o));
    let o = dedupvol(&["format", p, "--logical-size", "1000", "--physical-size", "64M"]);
    assert!(!o.status.success() && text(&o).contains("multiple of 4096"), "{}", text(&o));
    // Every failed format above left nothing behind.
    assert!(!img.exists(), "a failed format left {p} behind");
    std::fs::write(&img, vec![0u8; 1 << 20]).expect("zeros");
    let o = dedupvol(&["stats", p]);
    assert!(!o.status.success() && text(&o).contains("does not hold a dedupvol volume"), "{}", text(&o));
    assert!(dedupvol(&["format", p, "--logical-size", "1G", "--physical-size", "64M"]).status.success());
    let o = dedupvol(&["format", p, "--logical-size", "1G"]);
    assert!(!o.status.success() && text(&o).contains("--force"), "{}", text(&o));
    let big = dir.path().join("big.bin");
    std::fs::write(&big, vec![1u8; 8192]).expect("write");
    let o = dedupvol(&["import", p, big.to_str().expect("utf8"), "--offset", "1G"]);
    assert!(!o.status.success() && text(&o).contains("does not fit"), "{}", text(&o));
}

#[test]
fn import_export_stats_check_and_repair() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = dir.path().join("v.img");
    let p = img.to_str().expect("utf8");
    assert!(dedupvol(&[
        "format",
        p,
        "--logical-size",
        "256M",
        "--physical-size",
        "64M",
        "--index-memory",
        "1M",
        "--slab-size",
        "1M"
    ])
    .status
    .success());
    // Text-like data with repeats: reduces by dedup and compression.
    let mut data = Vec::new();
    for i in 0..2048u32 {
        let line = format!("line {} of a file that repeats itself every so often\n", i % 300);
        data.extend_from_slice(line.as_bytes());
    }
    let unit = data.clone();
    for _ in 0..40 {
        data.extend_from_slice(&unit);
    }
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).expect("write");
    let o = dedupvol(&["import", p, src.to_str().expect("utf8"), "--offset", "8M"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = dir.path().join("out.bin");
    assert!(dedupvol(&["export", p, out.to_str().expect("utf8")]).status.success());
    let back = std::fs::read(&out).expect("read");
    assert_eq!(&back[8 << 20..(8 << 20) + data.len()], &data[..]);
    assert!(back[..8 << 20].iter().all(|&b| b == 0));
    // At an unaligned offset every 1 MiB chunk boundary of the parallel import falls inside
    // a block, so two copy streams read-modify-write the same block.
    let odd = (24 << 20) + 1000;
    let o = dedupvol(&["import", p, src.to_str().expect("utf8"), "--offset", &odd.to_string()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(dedupvol(&["export", p, out.to_str().expect("utf8")]).status.success());
    let back = std::fs::read(&out).expect("read");
    assert_eq!(&back[odd..odd + data.len()], &data[..]);
    assert_eq!(&back[8 << 20..(8 << 20) + data.len()], &data[..]);
    let o = dedupvol(&["stats", p, "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    for field in [
        "logical_size_bytes",
        "logical_bytes_used",
        "physical_data_bytes_used",
        "metadata_bytes",
        "savings",
        "index_entries",
        "index_memory_bytes",
        "io",
    ] {
        assert!(s.get(field).is_some(), "stats --json lacks {field}");
    }
    for cat in [
        "data_write",
        "data_read",
        "journal_write",
        "block_map_read",
        "block_map_write",
        "refcount_write",
        "index_read",
        "verify_read",
    ] {
        assert!(s["io"].get(cat).and_then(|c| c.get("bytes")).is_some(), "io lacks {cat}");
    }
    assert!(s["savings"]["dedup_bytes"].as_u64().unwrap_or(0) > 0, "{s}");
    assert!(s["savings"]["compression_bytes"].as_u64().unwrap_or(0) > 0, "{s}");
    let o = dedupvol(&["check", p]);
    assert!(o.status.success() && text(&o).contains("clean"), "{}", text(&o));

    // A second session, so the journal no longer holds the first import's entries.
    let small = dir.path().join("small.bin");
    std::fs::write(&small, vec![7u8; 4096]).expect("write");
    assert!(dedupvol(&["import", p, small.to_str().expect("utf8"), "--offset", "100M"]).status.success());
    // Destroy both slots of refcount page 0: check reports wrong counts, repair fixes them.
    let info = text(&dedupvol(&["info", p]));
    let journal_blocks: u64 = info
        .lines()
        .find(|l| l.trim_start().starts_with("journal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("journal blocks");
    let rc_start = 2 + journal_blocks;
    let f = std::fs::OpenOptions::new().write(true).open(&img).expect("open");
    f.write_all_at(&vec![0xEEu8; 8192], rc_start * 4096).expect("corrupt");
    drop(f);
    // Exit codes as fsck's: 4 problems left, 1 repaired, 0 clean.
    let o = dedupvol(&["check", p]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("reference count"), "{}", text(&o));
    let o = dedupvol(&["check", p, "--repair"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("repaired"), "{}", text(&o));
    let o = dedupvol(&["check", p]);
    assert!(o.status.success() && text(&o).contains("clean"), "after repair: {}", text(&o));

    // Flip a byte inside the data region: check names the affected logical blocks.
    let json: serde_json::Value = serde_json::from_slice(&dedupvol(&["stats", p, "--json"]).stdout).expect("json");
    let used = json["data_blocks_used"].as_u64().expect("used");
    assert!(used > 0);
    let len = std::fs::metadata(&img).expect("meta").len();
    let data_start = len / 4096 - json["data_blocks_total"].as_u64().expect("total");
    let f = std::fs::OpenOptions::new().write(true).open(&img).expect("open");
    f.write_all_at(&[0x5Au8; 16], data_start * 4096 + 100).expect("flip");
    drop(f);
    let o = dedupvol(&["check", p]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("checksum mismatch") && text(&o).contains("lost (read as I/O errors)"), "{}", text(&o));
    // Reading the damaged block is an I/O error, not wrong data.
    let o = dedupvol(&["export", p, out.to_str().expect("utf8")]);
    assert!(!o.status.success() && text(&o).contains("checksum"), "{}", text(&o));
    // --repair cannot bring the data back: problems are left (4) and the ranges are named.
    let o = dedupvol(&["check", p, "--repair"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("lost: offset"), "{}", text(&o));
    // --unmap-lost needs --repair (a usage error), and with it the volume is clean again.
    assert_eq!(dedupvol(&["check", p, "--unmap-lost"]).status.code(), Some(2));
    let o = dedupvol(&["check", p, "--repair", "--unmap-lost"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unmapped"), "{}", text(&o));
    let o = dedupvol(&["check", p]);
    assert_eq!(o.status.code(), Some(0), "after unmapping the lost blocks: {}", text(&o));
    // An audit that cannot run is an operation error (8).
    let o = dedupvol(&["check", dir.path().join("missing.img").to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
}

/// A default (zstd, rest level 6) volume forms 16 KiB extents; `import --settle` of a few
/// MiB of text trains the volume's dictionary, `info` and `stats --json` name it, the data
/// exports unchanged and `check` is clean, also after a reopen. A volume without a rest
/// level keeps 64 KiB extents and says it trains none.
#[test]
fn settling_trains_a_dictionary_that_info_and_stats_name() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = dir.path().join("v.img");
    let p = img.to_str().expect("utf8");
    let fmt = |extra: &[&str]| {
        let mut args = vec!["format", p, "--logical-size", "64M", "--physical-size", "64M", "--force"];
        args.extend_from_slice(extra);
        let o = dedupvol(&args);
        assert!(o.status.success(), "{}", text(&o));
    };
    fmt(&[]);
    let stats = |p: &str| -> serde_json::Value {
        let o = dedupvol(&["stats", p, "--json"]);
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_slice(&o.stdout).expect("json")
    };
    let s = stats(p);
    assert_eq!(s["extent_blocks_max"], 4, "{s}");
    assert!(s["dictionary"].is_null(), "{s}");
    assert!(text(&dedupvol(&["info", p])).contains("dictionary      none yet"));
    // 6 MiB of text sharing a vocabulary, every block different.
    let words = ["fn ", "let ", "mut ", "self", ".map(", "|x| ", "Result<", "Option<", "impl ", "pub ", "{\n", "}\n"];
    let mut data = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while data.len() < 6 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(words[(x % words.len() as u64) as usize].as_bytes());
        data.extend_from_slice(format!("{}", x % 1000).as_bytes());
    }
    data.truncate(6 << 20);
    let src = dir.path().join("text.bin");
    std::fs::write(&src, &data).expect("write");
    let o = dedupvol(&["import", p, src.to_str().expect("utf8"), "--settle"]);
    assert!(o.status.success(), "{}", text(&o));
    let s = stats(p);
    // `stats --json`: [id, bytes]; `info --json`: named fields.
    assert!(s["dictionary"][0].as_u64().is_some_and(|id| id >= 1 << 16), "{s}");
    assert!(s["dictionary"][1].as_u64().is_some_and(|b| b > 0 && b <= 112 << 10), "{s}");
    let o = dedupvol(&["info", p, "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("info json");
    assert_eq!(j["dictionary_id"], s["dictionary"][0], "{j}");
    let info = text(&dedupvol(&["info", p]));
    assert!(info.contains("dictionary      ") && info.contains("(id "), "{info}");
    let out = dir.path().join("out.bin");
    let o = dedupvol(&["export", p, out.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", text(&o));
    let back = std::fs::read(&out).expect("read");
    assert!(back.get(..data.len()) == Some(&data[..]), "exported data differs");
    let o = dedupvol(&["check", p]);
    assert!(o.status.success() && text(&o).contains("clean"), "{}", text(&o));
    // Without a rest level: 64 KiB extents, and no dictionary is ever trained.
    fmt(&["--rest-level", "off"]);
    let s = stats(p);
    assert_eq!(s["extent_blocks_max"], 16, "{s}");
    assert!(text(&dedupvol(&["info", p])).contains("trained only in volumes with a rest level"));
}
