//! Crash durability through the server: fio writes a region and flushes it (end_fsync →
//! NBD_CMD_FLUSH) under the lazy `async` write policy, a second fio job keeps writing
//! elsewhere, the server is killed with SIGKILL in the middle of that job, and after a
//! restart (journal replay) fio's verify-only pass finds every flushed block intact.

mod nbd_common;
use nbd_common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn fio_base(dir: &std::path::Path, uri: &str, name: &str) -> Command {
    let mut c = Command::new("fio");
    // fio drops verify state files in its working directory: keep them in the test's.
    c.current_dir(dir);
    c.args([&format!("--name={name}"), "--ioengine=nbd", &format!("--uri={uri}"), "--bs=4k", "--iodepth=16"]);
    c
}

fn flushed_job(dir: &std::path::Path, uri: &str, verify_only: bool) -> Command {
    let mut c = fio_base(dir, uri, "flushed");
    c.args([
        "--rw=randwrite",
        "--offset=0",
        "--size=16m",
        "--randseed=42",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--buffer_compress_percentage=50",
        "--dedupe_percentage=30",
    ]);
    if verify_only {
        c.arg("--verify_only=1");
    } else {
        // Write only; the flush at the end is what makes the data durable.
        c.args(["--do_verify=0", "--end_fsync=1"]);
    }
    c
}

#[test]
fn kill9_after_flush_keeps_flushed_data() {
    let test = "kill9_after_flush_keeps_flushed_data";
    if !require_engine(test, &["fio"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--write-policy", "async"]);
    run(&mut flushed_job(dir.path(), &srv.uri, false));

    // Keep writing another region, and crash the server while those writes are in flight.
    let mut busy = fio_base(dir.path(), &srv.uri, "unflushed")
        .args(["--rw=randwrite", "--offset=32m", "--size=16m", "--time_based", "--runtime=60"])
        .args(["--status-interval=1", "--output-format=terse"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fio");
    let stdout = busy.stdout.take().expect("stdout");
    let mut written_kb = 0u64;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("fio output");
        let f: Vec<&str> = line.split(';').collect();
        // Terse v3: field 3 is the job name, field 47 the KiB written so far.
        if f.get(2) == Some(&"unflushed") {
            written_kb = f.get(46).and_then(|s| s.parse().ok()).unwrap_or(0);
            if written_kb > 0 {
                break;
            }
        }
    }
    assert!(written_kb > 0, "the second fio job never reported writing");
    eprintln!("{test}: killing the server with SIGKILL after the unflushed job wrote {written_kb} KiB");
    srv.kill9();
    let _ = busy.kill();
    let _ = busy.wait();

    // Restart: the volume replays its journal; every flushed block must verify.
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    run(&mut flushed_job(dir.path(), &srv.uri, true));
    assert!(srv.stop().success());
}
