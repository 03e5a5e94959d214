//! `nbdcopy` (multi-conn, several requests in flight) copies a file into the volume and
//! back out unchanged, across a clean server restart.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

#[test]
fn nbdcopy_round_trip_across_restart() {
    if !require("nbdcopy_round_trip_across_restart", &["nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "32M", "64M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    // nbdcopy wants the source no larger than the destination: copy exactly the volume.
    let data = make_data(srv.size as usize, 2);
    let input = dir.path().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(&input).arg(&srv.uri));
    let out1 = dir.path().join("out1.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&out1));
    assert_same(&std::fs::read(&out1).unwrap(), &data, "nbdcopy round trip");
    assert!(srv.stop().success());
    if in_memory() {
        eprintln!("SKIPPED: restart half of nbdcopy_round_trip_across_restart (in-memory mode has no volume)");
        return;
    }
    // After a clean close and reopen, the data is still there.
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let out2 = dir.path().join("out2.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&out2));
    assert_same(&std::fs::read(&out2).unwrap(), &data, "nbdcopy after restart");
    assert!(srv.stop().success());
}
