//! A real file system on the volume: nbdfuse exposes the export as a file, mkfs.ext4
//! formats it, the kernel mounts it through a loop device, a directory tree with
//! duplicate files is copied in, `e2fsck -fn` finds it clean, a remount reads every file
//! back with the same checksum, and after a clean server stop `dedupvol stats --json`
//! shows that the duplicates and compressible data took less physical space.

mod nbd_common;
use nbd_common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn make_tree(root: &Path) {
    // 12 distinct files, each also copied into a second directory: half the logical data
    // is duplicate, and each file is half compressible text.
    for d in ["a", "b/c"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for i in 0..12u64 {
        let data = make_data(((i as usize % 4) + 1) * 300_000 + i as usize * 7, 100 + i);
        std::fs::write(root.join("a").join(format!("f{i}.bin")), &data).unwrap();
        std::fs::write(root.join("b/c").join(format!("copy{i}.bin")), &data).unwrap();
    }
    std::fs::write(root.join("empty"), b"").unwrap();
    // `yes | head -c 2M`: 512 copies of one compressible block, past the reference cap
    // while its packed block is open (once "JBD2: I/O error" and a failed volume).
    std::fs::write(root.join("yes.txt"), b"y\n".repeat(1 << 20)).unwrap();
}

fn checksums(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                if p.file_name().is_some_and(|n| n == "lost+found") {
                    continue;
                }
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.insert(rel, blake3::hash(&std::fs::read(&p).unwrap()).to_hex().to_string());
            }
        }
    }
    out
}

fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

#[test]
fn nbdfuse_ext4_tree_survives_fsck_and_remount() {
    let test = "nbdfuse_ext4_tree_survives_fsck_and_remount";
    if !require(test, &["nbdfuse", "fusermount3", "mkfs.ext4", "e2fsck", "mount", "umount"]) {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() || !Path::new("/dev/loop-control").exists() {
        eprintln!("SKIPPED: {test}: needs root, /dev/fuse and loop devices — this test did NOT run");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "128M", "128M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
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

    run(Command::new("mkfs.ext4").args(["-F", "-q", "-b", "4096"]).arg(&disk));
    run(Command::new("mount").args(["-o", "loop"]).arg(&disk).arg(&loop_mnt));
    let src = dir.path().join("src");
    make_tree(&src);
    copy_tree(&src, &loop_mnt.join("tree"));
    mounts.umount_loop();
    run(Command::new("e2fsck").arg("-fn").arg(&disk));
    run(Command::new("mount").args(["-o", "loop,ro"]).arg(&disk).arg(&loop_mnt));
    let want = checksums(&src);
    let got = checksums(&loop_mnt.join("tree"));
    assert_eq!(want.len(), 26);
    assert_eq!(got, want, "file checksums differ after remount");
    mounts.umount_loop();
    run(Command::new("fusermount3").arg("-u").arg(&fuse_dir));
    if let Some(mut c) = mounts.nbdfuse.take() {
        let status = wait_timeout(&mut c, Duration::from_secs(30));
        assert!(status.success(), "nbdfuse exited with {status}");
    }
    assert!(srv.stop().success(), "server did not stop cleanly");

    if in_memory() {
        eprintln!("SKIPPED: stats half of {test} (in-memory mode has no volume)");
        return;
    }
    let out = run(Command::new(dedupvol()).arg("stats").arg(&vol).arg("--json"));
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("stats JSON: {e}\n{out}"));
    let logical = stats["logical_bytes_used"].as_u64().expect("logical_bytes_used");
    let physical = stats["physical_data_bytes_used"].as_u64().expect("physical_data_bytes_used");
    let ratio = stats["reduction_ratio"].as_f64().expect("reduction_ratio");
    eprintln!("nbdfuse+ext4: logical {logical} bytes, physical {physical} bytes, reduction {ratio:.2}x");
    // The tree is ~7 MiB of data stored twice, half compressible, plus ext4 metadata.
    assert!(logical > 10 << 20, "too little data reached the volume: {logical}");
    assert!(ratio > 1.5 && physical * 3 < logical * 2, "expected reduction, got {stats}");
    // The counters the server's process kept reach the stored volume at close, so this
    // separate `stats` process reports them (it used to report only its own, all zero).
    let written = stats["lifetime"]["blocks_written"].as_u64().expect("lifetime.blocks_written");
    assert!(written >= logical / 4096, "lifetime blocks_written {written} < mapped blocks: {stats}");
    assert_eq!(stats["counters"]["blocks_written"], 0, "the stats process writes nothing");
}
