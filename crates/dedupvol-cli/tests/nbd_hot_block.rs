//! Regression test (real client): `qemu-io -f raw -c 'write -P 0x57 0 1M' nbd+unix://…` on a
//! fresh volume got EIO "reference count of block 0 would exceed 254", and from then on
//! every write or flush from any client got EIO ("volume is failed … reopen it") until the
//! server restarted. 256 copies of one compressible block in one request pass the reference
//! cap while their packed block is still open; a hot block getting a new copy must never
//! be an error, and no client's write may fail the volume for everyone.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

fn qemu_io(uri: &str, cmd: &str) -> String {
    run(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, uri]))
}

#[test]
fn one_megabyte_of_one_byte_does_not_fail_the_volume() {
    if !require_engine("one_megabyte_of_one_byte_does_not_fail_the_volume", &["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let vol = format_volume(dir.path(), "64M", "64M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    qemu_io(&srv.uri, "write -P 0x57 0 1M");
    // More hot writes, from new connections, then read every pattern back.
    qemu_io(&srv.uri, "write -P 0x58 1M 2M");
    qemu_io(&srv.uri, "write -P 0x57 4M 1M");
    qemu_io(&srv.uri, "flush");
    let out = qemu_io(&srv.uri, "read -P 0x57 0 1M");
    assert!(out.contains("read 1048576/1048576"), "{out}");
    qemu_io(&srv.uri, "read -P 0x58 1M 2M");
    qemu_io(&srv.uri, "read -P 0x57 4M 1M");
    assert!(srv.stop().success());
    let out = run(Command::new(dedupvol()).arg("check").arg(&vol));
    assert!(out.contains("clean"), "{out}");
}
