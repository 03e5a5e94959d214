//! `base:allocation` with real clients: `nbdinfo --map` and `qemu-img map` see the volume's
//! holes (never-written and zero blocks) and data exactly where they are; `nbdcopy` and
//! `qemu-img convert` copy it out unchanged and skip the holes (the server's own counters
//! show they read about the data, not the whole export).

mod nbd_common;
use nbd_common::*;
use std::path::Path;
use std::process::Command;

const MIB: u64 = 1 << 20;
/// Where the source image holds data (offset, length); the rest is zeros.
const DATA: [(u64, u64); 3] = [(MIB, MIB), (5 * MIB + 4096, 8192), (15 * MIB, MIB)];
const SIZE: u64 = 16 * MIB;

/// A 16 MiB image: random data at `DATA`, zeros elsewhere.
fn source(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
    let mut img = vec![0u8; SIZE as usize];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for (off, len) in DATA {
        for b in &mut img[off as usize..(off + len) as usize] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8 | 1;
        }
    }
    let path = dir.join("src.raw");
    std::fs::write(&path, &img).unwrap();
    (path, img)
}

/// The expected map: (offset, length, is_data), runs merged.
fn expected_map() -> Vec<(u64, u64, bool)> {
    let mut out = Vec::new();
    let mut at = 0;
    for (off, len) in DATA {
        if off > at {
            out.push((at, off - at, false));
        }
        out.push((off, len, true));
        at = off + len;
    }
    if at < SIZE {
        out.push((at, SIZE - at, false));
    }
    out
}

/// Bytes the server has answered NBD reads for, from its admin socket.
fn served_read_bytes(vol: &Path, dir: &Path) -> u64 {
    let out =
        run(Command::new(dedupvol()).args(["stats", "--json"]).arg(vol).env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir)));
    let j: serde_json::Value = serde_json::from_str(&out).expect("stats json");
    let cmds = j["server"]["commands"].as_array().expect("server commands").clone();
    cmds.iter().find(|c| c["command"] == "read").and_then(|c| c["bytes"].as_u64()).expect("read bytes")
}

#[test]
fn real_clients_see_holes_and_skip_them() {
    if !require_engine("real_clients_see_holes_and_skip_them", &["nbdinfo", "qemu-img", "nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "16M", "64M");
    let (src, img) = source(dir.path());
    run(Command::new(dedupvol()).arg("import").arg(&vol).arg(&src));
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "64M"]);
    let data_bytes: u64 = DATA.iter().map(|d| d.1).sum();

    // nbdinfo --map: "offset length type description" per extent.
    let map = run(Command::new("nbdinfo").arg("--map").arg(&srv.uri));
    let got: Vec<(u64, u64, bool)> = map
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let kind: u32 = f[2].parse().unwrap();
            assert!(kind == 0 || kind == 3, "unexpected extent type in {l:?}");
            (f[0].parse().unwrap(), f[1].parse().unwrap(), kind == 0)
        })
        .collect();
    assert_eq!(got, expected_map(), "nbdinfo --map:\n{map}");

    // qemu-img map: holes read as zeros and hold no data.
    let json = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw"]).arg(&srv.uri));
    let extents: Vec<serde_json::Value> = serde_json::from_str(&json).expect("qemu-img map json");
    let got: Vec<(u64, u64, bool)> = extents
        .iter()
        .map(|e| {
            let data = e["data"].as_bool().unwrap();
            assert_eq!(e["zero"].as_bool().unwrap(), !data, "a hole reads as zeros: {e}");
            (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap(), data)
        })
        .collect();
    assert_eq!(got, expected_map(), "qemu-img map:\n{json}");

    // Copies out: unchanged, and the holes were not read.
    let before = served_read_bytes(&vol, dir.path());
    let out1 = dir.path().join("nbdcopy.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&out1));
    assert_same(&std::fs::read(&out1).unwrap(), &img, "nbdcopy copy");
    let after_nbdcopy = served_read_bytes(&vol, dir.path());
    let read = after_nbdcopy - before;
    // Reads may round out to the clients' request size around the data, not to the export.
    assert!(read >= data_bytes && read <= data_bytes + 4 * MIB, "nbdcopy read {read} bytes for {data_bytes} of data");

    let out2 = dir.path().join("convert.raw");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw"]).arg(&srv.uri).arg(&out2));
    assert_same(&std::fs::read(&out2).unwrap(), &img, "qemu-img convert copy");
    let read = served_read_bytes(&vol, dir.path()) - after_nbdcopy;
    assert!(
        read >= data_bytes && read <= data_bytes + 4 * MIB,
        "qemu-img convert read {read} bytes for {data_bytes} of data"
    );

    assert!(srv.stop().success());
}
