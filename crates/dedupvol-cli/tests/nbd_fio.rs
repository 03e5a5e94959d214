//! fio's nbd engine: random writes with crc32c verification over deduplicating and
//! compressible buffers, several jobs (connections) at queue depth 16, then a separate
//! verify-only pass that re-reads everything after a clean server restart.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

fn fio(dir: &std::path::Path, uri: &str, verify_only: bool) -> Command {
    let mut c = Command::new("fio");
    // fio drops verify state files in its working directory: keep them in the test's.
    c.current_dir(dir);
    c.args([
        "--name=nbd_randwrite",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--numjobs=2",
        // Each job gets its own region so their verify headers never overwrite each other.
        "--offset_increment=16m",
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--dedupe_percentage=50",
        "--dedupe_mode=working_set",
        "--dedupe_working_set_percentage=10",
        "--buffer_compress_percentage=50",
        "--randseed=1234",
        "--end_fsync=1",
        "--group_reporting",
    ]);
    if verify_only {
        c.arg("--verify_only=1");
    }
    c
}

#[test]
fn fio_random_writes_verify() {
    if !require("fio_random_writes_verify", &["fio"]) {
        return;
    }
    let out = run(Command::new("fio").arg("--enghelp"));
    if !out.contains("nbd") {
        eprintln!("SKIPPED: fio_random_writes_verify: this fio has no nbd engine — this test did NOT run");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    // Write + verify in one run (fio reads back every block it wrote and checks its crc).
    let report = run(&mut fio(dir.path(), &srv.uri, false));
    assert!(report.contains("nbd_randwrite"), "{report}");
    if in_memory() {
        assert!(srv.stop().success());
        eprintln!("SKIPPED: verify-after-restart half of fio_random_writes_verify (in-memory mode)");
        return;
    }
    assert!(srv.stop().success());
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    run(&mut fio(dir.path(), &srv.uri, true));
    assert!(srv.stop().success());
}
