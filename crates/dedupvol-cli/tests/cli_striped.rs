//! `format --data-device` through the command line: a volume over four files, data in and
//! out, `check` clean, `info` and `stats --json` list every device with its bytes, and a
//! missing device is refused with an error naming it; `bench --mode stripe` prints its
//! table.
use std::process::Command;

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn ok(args: &[&str]) -> String {
    let o = dedupvol(args);
    assert!(o.status.success(), "dedupvol {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_volume_over_four_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = |n: &str| dir.path().join(n).display().to_string();
    let (a, b, c, d) = (p("a"), p("b"), p("c"), p("d"));
    ok(&[
        "format",
        &a,
        "--data-device",
        &b,
        "--data-device",
        &c,
        "--data-device",
        &d,
        "--physical-size",
        "24M",
        "--logical-size",
        "64M",
        "--index-memory",
        "1M",
    ]);
    // Formatting an extra device again is refused without --force.
    let o = dedupvol(&["format", &b, "--logical-size", "16M"]);
    assert!(!o.status.success(), "an extra data device was formatted over");
    let input = p("in");
    let data: Vec<u8> = (0..12u32 << 20).map(|i| ((i / 4096) % 97) as u8 ^ (i % 251) as u8).collect();
    std::fs::write(&input, &data).expect("input");
    ok(&["import", &a, &input]);
    let out = p("out");
    ok(&["export", &a, &out]);
    let back = std::fs::read(&out).expect("out");
    assert_eq!(&back[..data.len()], &data[..]);
    ok(&["check", &a]);
    let info = ok(&["info", &a]);
    assert!(info.contains("striped over  4 data devices"), "{info}");
    let stats: serde_json::Value = serde_json::from_str(&ok(&["stats", &a, "--json"])).expect("json");
    assert_eq!(stats["data_devices"].as_array().map(|v| v.len()), Some(4), "{stats}");
    // The export read from every device.
    let o = dedupvol(&["stats", &a]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("data device 3"));
    std::fs::rename(&c, p("c-aside")).expect("rename");
    let o = dedupvol(&["export", &a, &out]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("data device 2 of 4") && err.contains(&c), "{err}");
    let o = dedupvol(&["check", &a]);
    assert!(!o.status.success());
    std::fs::rename(p("c-aside"), &c).expect("rename back");
    ok(&["check", &a]);
}

#[test]
fn bench_stripe_prints_its_table() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().display().to_string();
    let out =
        ok(&["bench", "--mode", "stripe", "--size", "24M", "--dir", &d, "--index-memory", "4M", "--io", "buffered"]);
    for row in ["(a) 1 volume striped over 4 devices", "(b) 4 volumes, dedup per device", "(c) 1 volume on 1 device"] {
        assert!(out.contains(row), "{out}");
    }
    assert!(out.contains("per-device dedup stores"), "{out}");
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0, "device files left behind");
}
