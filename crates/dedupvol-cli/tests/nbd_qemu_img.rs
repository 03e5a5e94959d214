//! `qemu-img convert` a file into the volume and back out; the bytes must match, and the
//! rest of the volume must read back as zeros.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

#[test]
fn qemu_img_round_trip() {
    if !require("qemu_img_round_trip", &["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "64M");
    let data = make_data(24 << 20, 1);
    let input = dir.path().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&input).arg(&srv.uri));
    let output = dir.path().join("out.raw");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw"]).arg(&srv.uri).arg(&output));
    let back = std::fs::read(&output).unwrap();
    assert_eq!(back.len() as u64, srv.size);
    assert_same(&back[..data.len()], &data, "qemu-img round trip");
    assert!(back[data.len()..].iter().all(|&b| b == 0), "bytes past the copied file are not zero");
    assert!(srv.stop().success());
}
