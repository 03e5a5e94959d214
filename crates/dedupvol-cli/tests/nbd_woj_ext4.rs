//! Write-once journaling end to end: `dedupvol serve --woj auto` on a volume formatted with
//! `--dedup off`, ext4 made on it through nbdfuse and mounted with `data=journal`. The
//! server must find the journal after mkfs, share the checkpoint writes of files written
//! with fsyncs (most of the file data never written twice), and the file system must
//! come out of `e2fsck -fn` clean with every file reading back as written.

mod nbd_common;
use nbd_common::*;
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn woj_stats(vol: &Path, dir: &Path) -> serde_json::Value {
    let out =
        run(Command::new(dedupvol()).arg("stats").arg(vol).arg("--json").env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir)));
    let s: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("stats JSON: {e}\n{out}"));
    s["woj"].clone()
}

#[test]
fn woj_shares_ext4_data_journal_checkpoints() {
    let test = "woj_shares_ext4_data_journal_checkpoints";
    if !require_engine(test, &["nbdfuse", "fusermount3", "mkfs.ext4", "e2fsck", "mount", "umount"]) {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() || !Path::new("/dev/loop-control").exists() {
        eprintln!("SKIPPED: {test}: needs root, /dev/fuse and loop devices — this test did NOT run");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("vol.img");
    run(Command::new(dedupvol()).arg("format").arg(&vol).args([
        "--logical-size",
        "256M",
        "--physical-size",
        "256M",
        "--dedup",
        "off",
        "--compression",
        "none",
    ]));
    let srv = ServerProc::start(&vol, dir.path(), false, &["--woj", "auto"]);
    let fuse_dir = dir.path().join("fuse");
    let loop_mnt = dir.path().join("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&loop_mnt).unwrap();
    let pidfile = dir.path().join("nbdfuse.pid");
    let disk = fuse_dir.join("disk");
    let child =
        Command::new("nbdfuse").arg("-P").arg(&pidfile).arg(&disk).arg(&srv.uri).spawn().expect("spawn nbdfuse");
    let mut mounts = Mounts { loop_mnt: loop_mnt.clone(), fuse_dir: fuse_dir.clone(), nbdfuse: Some(child) };
    wait_for_file(&pidfile, Duration::from_secs(30));

    assert!(woj_stats(&vol, dir.path())["ranges"].as_array().is_some_and(|r| r.is_empty()), "journal before mkfs");
    run(Command::new("mkfs.ext4").args(["-F", "-q", "-b", "4096"]).arg(&disk));
    run(Command::new("mount").args(["-o", "loop,data=journal"]).arg(&disk).arg(&loop_mnt));
    let w = woj_stats(&vol, dir.path());
    assert_eq!(w["ranges"].as_array().map(Vec::len), Some(1), "the journal after mkfs and mount: {w}");
    // 4 files of 2 MiB of distinct data, an fsync every 16 blocks.
    let mut written = Vec::new();
    for f in 0..4u64 {
        let data = make_data(2 << 20, 500 + f);
        let mut file = std::fs::File::create(loop_mnt.join(format!("f{f}"))).unwrap();
        for (i, c) in data.chunks(4096).enumerate() {
            file.write_all(c).unwrap();
            if i % 16 == 15 {
                file.sync_all().unwrap();
            }
        }
        file.sync_all().unwrap();
        written.push(data);
    }
    run(Command::new("umount").arg(&loop_mnt));
    let w = woj_stats(&vol, dir.path());
    let hits = w["hits"].as_u64().unwrap_or(0);
    // 2,048 file data blocks went to the journal and then home: nearly all homes shared.
    assert!(hits >= 1900, "too few checkpoint writes shared: {w}");
    assert_eq!(w["collisions"], 0, "{w}");
    assert!(w["pool_bytes"].as_u64().unwrap_or(u64::MAX) <= 16 * w["journal_blocks"].as_u64().unwrap_or(0), "{w}");
    run(Command::new("e2fsck").arg("-fn").arg(&disk));
    run(Command::new("mount").args(["-o", "loop,ro"]).arg(&disk).arg(&loop_mnt));
    for (f, data) in written.iter().enumerate() {
        let got = std::fs::read(loop_mnt.join(format!("f{f}"))).unwrap();
        assert_same(&got, data, &format!("file f{f}"));
    }
    run(Command::new("umount").arg(&loop_mnt));
    run(Command::new("fusermount3").arg("-u").arg(&fuse_dir));
    if let Some(mut c) = mounts.nbdfuse.take() {
        let status = wait_timeout(&mut c, Duration::from_secs(30));
        assert!(status.success(), "nbdfuse exited with {status}");
    }
    assert!(srv.stop().success(), "server did not stop cleanly");
    let out = run(Command::new(dedupvol()).arg("check").arg(&vol));
    eprintln!("woj+ext4 data=journal: {hits} checkpoint writes shared; check: {}", out.trim());
}
