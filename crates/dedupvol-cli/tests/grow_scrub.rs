//! `dedupvol grow` and `dedupvol scrub`, on closed volumes and on served ones: a served
//! volume grows through its server and new NBD connections see the new size; a scrub
//! through the server runs while a client writes, finds injected damage, names the
//! logical blocks it costs and repairs it from the server's content cache.

mod nbd_common;
use nbd_common::*;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output};

fn cmd(dir: &Path, args: &[&str], vol: &Path) -> Output {
    Command::new(dedupvol())
        .arg(args[0])
        .arg(vol)
        .args(&args[1..])
        .env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir))
        .output()
        .expect("run dedupvol")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Formats an uncompressed volume (blocks stored verbatim, so they can be found and damaged).
fn format_raw(dir: &Path, logical: &str, physical: &str) -> std::path::PathBuf {
    let vol = dir.join("vol.img");
    run(Command::new(dedupvol()).arg("format").arg(&vol).args([
        "--logical-size",
        logical,
        "--physical-size",
        physical,
        "--compression",
        "none",
    ]));
    vol
}

/// Flips a byte of the device block holding exactly `content`; returns its offset.
fn damage(vol: &Path, content: &[u8]) -> u64 {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(vol).expect("open volume file");
    let len = f.metadata().expect("stat").len();
    let mut b = vec![0u8; 4096];
    let at = (0..len / 4096)
        .map(|i| i * 4096)
        .find(|&at| {
            f.read_exact_at(&mut b, at).expect("read");
            b == content
        })
        .expect("the block is on the device");
    f.write_all_at(&[content[77] ^ 0xA5], at + 77).expect("flip");
    f.sync_all().expect("sync");
    at
}

fn nbd_size(uri: &str) -> u64 {
    run(Command::new("nbdinfo").args(["--size", uri])).trim().parse().expect("nbdinfo --size")
}

#[test]
fn a_closed_volume_grows_shrinks_and_scrubs() {
    let dir = tempfile::tempdir().unwrap();
    let vol = format_raw(dir.path(), "16M", "32M");
    let data = make_data(4 << 20, 3);
    let input = dir.path().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    run(Command::new(dedupvol()).arg("import").arg(&vol).arg(&input));

    let o = cmd(dir.path(), &["grow", "--logical-size", "48M"], &vol);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("logical 16.00 MiB -> 48.00 MiB"), "{}", text(&o));
    let o = cmd(dir.path(), &["grow", "--physical-size", "64M", "--json"], &vol);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["physical_size_after"], 64u64 << 20);
    assert_eq!(std::fs::metadata(&vol).unwrap().len(), 64 << 20, "the file was extended");
    let o = cmd(dir.path(), &["grow", "--logical-size", "2M"], &vol);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("would lose"), "{}", text(&o));
    let o = cmd(dir.path(), &["grow", "--physical-size", "32M"], &vol);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("cannot shrink"), "{}", text(&o));
    let o = cmd(dir.path(), &["grow"], &vol);
    assert_eq!(o.status.code(), Some(2), "a size is required: {}", text(&o));

    let o = cmd(dir.path(), &["scrub"], &vol);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("damaged: 0"), "{}", text(&o));
    damage(&vol, &data[8192..12288]);
    let o = cmd(dir.path(), &["scrub", "--json", "--rate", "100"], &vol);
    assert_eq!(o.status.code(), Some(4), "damage left: {}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["status"]["damaged"], 1);
    assert_eq!(j["damage"][0]["lbas"][0], 2, "{j}");
    assert_eq!(j["lost_ranges"][0]["offset"], 8192);
    let o = cmd(dir.path(), &["check"], &vol);
    assert_eq!(o.status.code(), Some(4), "check agrees: {}", text(&o));
}

#[test]
fn a_served_volume_grows_and_is_scrubbed_while_a_client_writes() {
    if !require_engine(
        "a_served_volume_grows_and_is_scrubbed_while_a_client_writes",
        &["nbdinfo", "nbdcopy", "qemu-io"],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_raw(dir.path(), "16M", "64M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "32M"]);
    assert_eq!(nbd_size(&srv.uri), 16 << 20);

    // Grow while served: the next connection sees the new size.
    let o = cmd(dir.path(), &["grow", "--logical-size", "32M"], &vol);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("while served"), "{}", text(&o));
    assert_eq!(nbd_size(&srv.uri), 32 << 20, "a new connection sees the new size");
    let before = cmd(dir.path(), &["stats", "--json"], &vol);
    let before: serde_json::Value = serde_json::from_slice(&before.stdout).expect("stats json");
    let o = cmd(dir.path(), &["grow", "--physical-size", "128M", "--json"], &vol);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::metadata(&vol).unwrap().len(), 128 << 20, "the file was extended");
    let after = cmd(dir.path(), &["stats", "--json"], &vol);
    let after: serde_json::Value = serde_json::from_slice(&after.stdout).expect("stats json");
    let total = |j: &serde_json::Value| j["data_blocks_total"].as_u64().unwrap();
    assert!(total(&after) > total(&before) + 15_000, "new slabs: {} -> {}", total(&before), total(&after));
    let o = cmd(dir.path(), &["grow", "--logical-size", "1T"], &vol);
    assert_eq!(o.status.code(), Some(1), "beyond the room: {}", text(&o));
    assert!(text(&o).contains("room"), "{}", text(&o));

    // Data in the new space, then damage one block of it on the device.
    let data = make_data(8 << 20, 11);
    let input = dir.path().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    run(Command::new("nbdcopy").arg(&input).arg(&srv.uri).args(["--destination-is-zero"]));
    let victim = &data[4096 * 300..4096 * 301];
    damage(&vol, victim);

    // A client writes elsewhere (16M..24M, patterns changing) while the throttled scrub runs.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (uri, stop) = (srv.uri.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || rounds == 0 {
                let c = format!("write -P {} 16M 8M", 1 + rounds % 200);
                run(Command::new("qemu-io").args(["-f", "raw", "-c", &c, &uri]));
                rounds += 1;
            }
            rounds
        })
    };
    let o = cmd(dir.path(), &["scrub", "--repair", "--rate", "4", "--json"], &vol);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.join().expect("writer");
    assert!(rounds >= 2, "the client wrote during the scrub ({rounds} rounds)");
    assert_eq!(o.status.code(), Some(1), "damage found and repaired: {}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["status"]["damaged"], 1, "{j}");
    assert_eq!(j["damage"][0]["repaired_from"], "content cache", "{j}");
    let stats = cmd(dir.path(), &["stats", "--json"], &vol);
    let s: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats json");
    assert_eq!(s["scrub"]["repaired"], 1, "the last scrub in the server's stats: {s}");
    assert!(s["scrub"]["finished_unix"].as_u64().is_some());

    // A slow scrub, cancelled from another command: it stops early and says so.
    let slow = {
        let (dir, vol) = (dir.path().to_path_buf(), vol.clone());
        std::thread::spawn(move || cmd(&dir, &["scrub", "--rate", "1", "--json"], &vol))
    };
    let mut cancelled = None;
    for _ in 0..100 {
        let s = cmd(dir.path(), &["stats", "--json"], &vol);
        let s: serde_json::Value = serde_json::from_slice(&s.stdout).expect("stats json");
        if s["scrub"]["running"] == true {
            cancelled = Some(cmd(dir.path(), &["scrub", "--cancel"], &vol));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let c = cancelled.expect("the slow scrub was seen running");
    assert!(c.status.success(), "{}", text(&c));
    let o = slow.join().expect("slow scrub");
    assert_eq!(o.status.code(), Some(8), "a cancelled scrub is not a clean one: {}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["status"]["cancelled"], true, "{j}");

    assert!(srv.stop().success());
    // Served no more: the scrub opens the volume; the repair reached the device.
    let o = cmd(dir.path(), &["scrub"], &vol);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}
