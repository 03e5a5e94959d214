//! SIGTERM while a client is writing: the server stops accepting, answers what it already
//! took, closes the volume cleanly and exits 0. Data a client wrote but never flushed
//! (async write policy, no fsync) is durable anyway, because a clean close flushes; and
//! `dedupvol check` finds the closed volume consistent.

mod nbd_common;
use nbd_common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn job(dir: &std::path::Path, uri: &str, verify_only: bool) -> Command {
    let mut c = Command::new("fio");
    c.current_dir(dir).args([
        "--name=unflushed_but_closed",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--offset=0",
        "--size=16m",
        "--randseed=7",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--buffer_compress_percentage=50",
    ]);
    // No end_fsync: only the server's clean close can make this durable.
    c.arg(if verify_only { "--verify_only=1" } else { "--do_verify=0" });
    c
}

#[test]
fn sigterm_during_writes_closes_cleanly() {
    let test = "sigterm_during_writes_closes_cleanly";
    if !require_engine(test, &["fio"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--write-policy", "async"]);
    run(&mut job(dir.path(), &srv.uri, false));

    let mut busy = Command::new("fio")
        .current_dir(dir.path())
        .args(["--name=busy", "--ioengine=nbd", &format!("--uri={}", srv.uri)])
        .args(["--rw=randwrite", "--bs=64k", "--iodepth=16", "--offset=32m", "--size=16m"])
        .args(["--time_based", "--runtime=60", "--status-interval=1", "--output-format=terse"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fio");
    let stdout = busy.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut written_kb = 0u64;
    for line in lines.by_ref() {
        let line = line.expect("fio output");
        let f: Vec<&str> = line.split(';').collect();
        // Terse v3: field 3 is the job name, field 47 the KiB written so far.
        if f.get(2) == Some(&"busy") {
            written_kb = f.get(46).and_then(|s| s.parse().ok()).unwrap_or(0);
            if written_kb > 0 {
                break;
            }
        }
    }
    assert!(written_kb > 0, "the busy fio job never reported writing");
    let status = srv.stop();
    assert!(status.success(), "server exited with {status} after SIGTERM with a client writing");
    let _ = busy.kill();
    let _ = busy.wait();

    run(Command::new(dedupvol()).arg("check").arg(&vol));
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    run(&mut job(dir.path(), &srv.uri, true));
    assert!(srv.stop().success());
}
