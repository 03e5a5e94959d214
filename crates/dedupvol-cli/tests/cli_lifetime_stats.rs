//! `stats` on a closed volume reports what happened to it over its life.
//!
//! The bug this pins: `dedupvol stats` printed only the counters of the `stats` process
//! itself, so right after `import` it reported `blocks_written 0`. The volume now keeps
//! lifetime counters in its superblock; `stats` shows them (text and `--json`), and keeps
//! this process's counters apart.
use std::process::Command;

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn stats_json(vol: &str) -> serde_json::Value {
    let o = dedupvol(&["stats", vol, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).expect("stats --json")
}

#[test]
fn stats_in_a_new_process_shows_what_import_wrote() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = dir.path().join("v.img");
    let vol = img.to_str().expect("utf8");
    let o = dedupvol(&["format", vol, "--logical-size", "64M", "--physical-size", "64M"]);
    assert!(o.status.success(), "{}", text(&o));
    // 256 blocks: 128 distinct (no all-zero block), each twice.
    let mut data = Vec::with_capacity(1 << 20);
    for i in 0..256u32 {
        let mut b = vec![0u8; 4096];
        for (j, x) in b.iter_mut().enumerate() {
            *x = ((i % 128) as u8).wrapping_mul(31) ^ (j as u8) | 1;
        }
        b[..4].copy_from_slice(&(i % 128).to_le_bytes());
        data.extend_from_slice(&b);
    }
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).expect("write source");
    let o = dedupvol(&["import", vol, src.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", text(&o));

    let s = stats_json(vol);
    assert_eq!(s["counters"]["blocks_written"], 0, "the stats process itself wrote nothing");
    let life = &s["lifetime"];
    assert_eq!(life["blocks_written"], 256, "{life}");
    assert_eq!(life["dedup_hits"], 128, "{life}");
    assert_eq!(life["read_write_opens"], 1, "{life}");
    assert_eq!(life["recoveries"], 0, "{life}");
    assert!(life["data_write_bytes"].as_u64().is_some_and(|b| b > 0), "{life}");

    // A second import adds to the counters; stats (read-only) adds nothing.
    let o = dedupvol(&["import", vol, src.to_str().expect("utf8"), "--offset", "8M"]);
    assert!(o.status.success(), "{}", text(&o));
    let life = stats_json(vol)["lifetime"].clone();
    assert_eq!(life["blocks_written"], 512, "{life}");
    assert_eq!(life["read_write_opens"], 2, "{life}");

    let o = dedupvol(&["stats", vol]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.lines().find(|l| l.starts_with("lifetime: written")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains(" 512 blocks") && line.contains("deduplicated 384"), "{out}");
}
