//! `nbdinfo` sees the export's size, flags and block sizes over TCP, and READ_ONLY when
//! served with --read-only.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

fn info(uri: &str) -> serde_json::Value {
    let out = run(Command::new("nbdinfo").args(["--json", uri]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{out}"));
    v["exports"][0].clone()
}

#[test]
fn nbdinfo_reports_size_and_flags() {
    if !require("nbdinfo_reports_size_and_flags", &["nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "64M");
    let srv = ServerProc::start(&vol, dir.path(), true, &[]);
    if !in_memory() {
        assert_eq!(srv.size, 64 << 20);
    }
    let e = info(&srv.uri);
    assert_eq!(e["export-size"].as_u64(), Some(srv.size), "{e}");
    for (k, want) in [
        ("is_read_only", false),
        ("can_flush", true),
        ("can_fua", true),
        ("can_trim", true),
        ("can_zero", true),
        ("can_multi_conn", true),
    ] {
        assert_eq!(e[k].as_bool(), Some(want), "{k} in {e}");
    }
    assert_eq!(e["block_size_minimum"].as_u64(), Some(1));
    assert_eq!(e["block_size_preferred"].as_u64(), Some(4096));
    assert_eq!(e["block_size_maximum"].as_u64(), Some(32 << 20));
    assert!(srv.stop().success());

    let srv = ServerProc::start(&vol, dir.path(), true, &["--read-only", "--export-name", "ro"]);
    let e = info(&srv.uri.replace("/dedupvol", "/ro"));
    assert_eq!(e["is_read_only"].as_bool(), Some(true), "{e}");
    assert!(srv.stop().success());
}
