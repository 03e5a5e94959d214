//! A full volume through the server: incompressible data larger than the physical space
//! makes writes fail with ENOSPC at the client (engine `Error::errno()` → NBD_ENOSPC), the
//! server keeps serving, every block reads back as either what was written or zeros
//! (never anything else), and it still stops cleanly with a volume `check` accepts.

mod nbd_common;
use nbd_common::*;
use std::process::Command;

fn incompressible(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

#[test]
fn full_volume_reports_enospc_and_stays_consistent() {
    let test = "full_volume_reports_enospc_and_stays_consistent";
    if !require_engine(test, &["nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "24M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let data = incompressible(srv.size as usize, 99);
    let input = dir.path().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    let out = Command::new("nbdcopy").arg(&input).arg(&srv.uri).output().expect("run nbdcopy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "64 MiB of random data fit in 24 MiB?");
    assert!(stderr.contains("No space left on device"), "expected ENOSPC, nbdcopy said: {stderr}");

    // Still serving: read everything back over a new connection.
    let back_path = dir.path().join("back.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&back_path));
    let back = std::fs::read(&back_path).unwrap();
    assert_eq!(back.len(), data.len());
    let (mut written, mut zero) = (0usize, 0usize);
    for (i, (got, want)) in back.chunks(4096).zip(data.chunks(4096)).enumerate() {
        if got == want {
            written += 1;
        } else if got.iter().all(|&b| b == 0) {
            zero += 1;
        } else {
            panic!("block {i} is neither the written data nor zeros");
        }
    }
    eprintln!("{test}: {written} blocks stored, {zero} refused before the volume filled");
    assert!(written > 1000 && zero > 1000, "written {written}, zero {zero}");
    let status = srv.stop();
    assert!(status.success(), "server exited with {status}");
    run(Command::new(dedupvol()).arg("check").arg(&vol));
}
