//! Two servers must never write one volume: a second `dedupvol serve` of a volume being
//! served read-write exits with an error instead of opening it (and replaying its journal
//! under the first server's feet). Read-only servers may share a volume.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

#[test]
fn a_served_volume_cannot_be_served_again() {
    let test = "a_served_volume_cannot_be_served_again";
    if in_memory() {
        eprintln!("SKIPPED: {test}: needs the engine (in-memory mode) — this test did NOT run");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "16M", "32M");
    let first = ServerProc::start(&vol, dir.path(), false, &[]);
    let out = Command::new(dedupvol())
        .arg("serve")
        .arg(&vol)
        .arg("--socket")
        .arg(dir.path().join("second.sock"))
        .output()
        .expect("run second server");
    assert!(!out.status.success(), "a second server opened a volume already being served");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("already being served"), "{stderr}");
    assert!(out.stdout.is_empty(), "the second server printed a readiness line");
    assert!(first.stop().success());

    // Two read-only servers can share it.
    let sub = dir.path().join("ro2");
    std::fs::create_dir_all(&sub).unwrap();
    let a = ServerProc::start(&vol, dir.path(), false, &["--read-only"]);
    let b = ServerProc::start(&vol, &sub, false, &["--read-only"]);
    assert!(a.stop().success() && b.stop().success());
}
