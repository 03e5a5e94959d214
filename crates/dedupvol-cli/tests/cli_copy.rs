//! Regression tests: `import` and `export` against what they copy from and to.
//!
//! - `export v.img v.img` truncated and destroyed the volume, and `import v.img v.img`
//!   overwrote it: the other side is now compared with the volume's devices by device and
//!   inode (through symlinks and redirected stdin/stdout too) and refused.
//! - `export` could not write to a block device, a pipe or `/dev/null` (it truncated and
//!   resized its target), and `import -` (stdin) was not accepted.
//! - A damaged data block stopped `export` at the first one with the offset of the 1 MiB
//!   chunk, not of the block; nothing got the rest out. `export --skip-bad` writes zeros
//!   for unreadable blocks and lists the lost ranges (exit 1).
//! - SIGTERM during `import` exited 143 silently and left nothing mapped: it now stops after
//!   the chunks in progress, flushes and closes, and says where to resume
//!   (`--offset` / `--input-offset`).
//! - A directory given as a volume or as the other side said "too small", not "is a
//!   directory".
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

/// Deterministic incompressible bytes (xorshift), so every 4 KiB block is unique.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A 64 MiB volume holding `data` at offset 0.
fn volume_with(dir: &Path, data: &[u8], extra: &[&str]) -> std::path::PathBuf {
    let vol = dir.join("v.img");
    let input = dir.join("in.bin");
    std::fs::write(&input, data).expect("write input");
    let mut args = vec!["format", s(&vol), "--logical-size", "64M", "--physical-size", "64M"];
    args.extend_from_slice(extra);
    let o = dedupvol(&args);
    assert!(o.status.success(), "{}", text(&o));
    let o = dedupvol(&["import", s(&vol), s(&input)]);
    assert!(o.status.success(), "{}", text(&o));
    vol
}

fn assert_volume_intact(vol: &Path, data: &[u8]) {
    let out = vol.with_file_name("check.raw");
    let o = dedupvol(&["export", s(vol), s(&out)]);
    assert!(o.status.success(), "the volume no longer exports: {}", text(&o));
    let got = std::fs::read(&out).expect("read export");
    assert!(got[..data.len()] == *data, "the volume's data changed");
    std::fs::remove_file(&out).expect("rm");
}

#[test]
fn export_and_import_refuse_the_volume_itself() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = noise(2 << 20, 1);
    let vol = volume_with(dir.path(), &data, &[]);
    let link = dir.path().join("link.img");
    std::os::unix::fs::symlink(&vol, &link).expect("symlink");
    for args in [
        vec!["export", s(&vol), s(&vol)],
        vec!["export", s(&vol), s(&link)],
        vec!["import", s(&vol), s(&vol)],
        vec!["import", s(&link), s(&vol)],
    ] {
        let o = dedupvol(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("the volume's own device"), "{args:?}: {}", text(&o));
    }
    // The same file reached through stdin and stdout.
    for (cmd, stdin, stdout) in [("import", true, false), ("export", false, true)] {
        let f = || std::fs::OpenOptions::new().read(true).append(true).open(&vol).expect("open volume");
        let o = Command::new(env!("CARGO_BIN_EXE_dedupvol"))
            .args([cmd, s(&vol), "-"])
            .stdin(if stdin { Stdio::from(f()) } else { Stdio::null() })
            .stdout(if stdout { Stdio::from(f()) } else { Stdio::piped() })
            .stderr(Stdio::piped())
            .output()
            .expect("run");
        assert_eq!(o.status.code(), Some(1), "{cmd} -: {}", text(&o));
        assert!(text(&o).contains("the volume's own device"), "{cmd} -: {}", text(&o));
    }
    assert_eq!(std::fs::metadata(&vol).expect("stat").len(), 64 << 20);
    assert_volume_intact(&vol, &data);
}

#[test]
fn export_writes_to_stdout_pipes_and_dev_null_and_import_reads_stdin() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = noise(3 << 20, 2);
    let vol = volume_with(dir.path(), &data, &[]);
    let o = dedupvol(&["export", s(&vol), "/dev/null"]);
    assert!(o.status.success(), "/dev/null: {}", text(&o));
    let o = dedupvol(&["export", s(&vol), "-"]);
    assert!(o.status.success(), "stdout: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), 64 << 20, "stdout carries exactly the volume");
    assert!(o.stdout[..data.len()] == *data && o.stdout[data.len()..].iter().all(|&b| b == 0));
    // A named pipe, read by another thread.
    let fifo = dir.path().join("fifo");
    let st = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(st.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).expect("read fifo"))
    };
    let o = dedupvol(&["export", s(&vol), s(&fifo)]);
    assert!(o.status.success(), "fifo: {}", text(&o));
    let got = reader.join().expect("reader");
    assert_eq!(got.len(), 64 << 20);
    assert!(got[..data.len()] == *data);
    // import - at an offset, from a pipe.
    let more = noise(1 << 20, 3);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupvol"))
        .args(["import", s(&vol), "-", "--offset", "8M"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child.stdin.take().expect("stdin").write_all(&more).expect("feed");
    let o = child.wait_with_output().expect("wait");
    assert!(o.status.success(), "import -: {}", text(&o));
    let o = dedupvol(&["export", s(&vol), "-"]);
    assert!(o.stdout[8 << 20..(8 << 20) + more.len()] == *more, "stdin import landed at --offset");
    // A stream longer than the room after --offset: an error naming it, and what fitted is
    // flushed and the volume closed cleanly.
    let long = noise(3 << 20, 8);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupvol"))
        .args(["import", s(&vol), "-", "--offset", "62M"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&long);
    });
    let o = child.wait_with_output().expect("wait");
    feeder.join().expect("feeder");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("larger than the volume") && text(&o).contains("2097152 bytes were copied"),
        "{}",
        text(&o)
    );
    let o = dedupvol(&["check", s(&vol)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = dedupvol(&["export", s(&vol), "-"]);
    assert!(o.stdout[62 << 20..] == noise(3 << 20, 8)[..2 << 20], "what fitted is in the volume");
}

#[test]
fn export_and_import_use_a_block_device_without_resizing_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = noise(2 << 20, 4);
    let vol = volume_with(dir.path(), &data, &[]);
    let backing = dir.path().join("loop.img");
    // Old contents on the device that the export must overwrite (zeros are written too).
    std::fs::write(&backing, vec![0xA5u8; 64 << 20]).expect("backing");
    let o = Command::new("losetup").args(["-f", "--show", s(&backing)]).output();
    let dev = match o {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            eprintln!("SKIPPED: losetup cannot attach a loop device here (needs root and /dev/loop-control)");
            return;
        }
    };
    let detach = Detach(dev.clone());
    let o = dedupvol(&["export", s(&vol), &dev]);
    assert!(o.status.success(), "export to {dev}: {}", text(&o));
    let mut got = vec![0u8; 64 << 20];
    std::fs::File::open(&dev).expect("open dev").read_exact_at(&mut got, 0).expect("read dev");
    assert!(got[..data.len()] == *data && got[data.len()..].iter().all(|&b| b == 0), "device holds the volume");
    // And back in, from the device, into a second volume.
    let vol2 = dir.path().join("v2.img");
    assert!(dedupvol(&["format", s(&vol2), "--logical-size", "64M", "--physical-size", "64M"]).status.success());
    let o = dedupvol(&["import", s(&vol2), &dev]);
    assert!(o.status.success(), "import from {dev}: {}", text(&o));
    assert!(text(&o).contains("imported 64.00 MiB"), "the device's size, not its metadata's 0: {}", text(&o));
    // A device smaller than the volume is refused before anything is written.
    drop(detach);
    std::fs::write(&backing, vec![0u8; 1 << 20]).expect("small backing");
    if let Ok(o) = Command::new("losetup").args(["-f", "--show", s(&backing)]).output() {
        let small = String::from_utf8_lossy(&o.stdout).trim().to_string();
        let _d = Detach(small.clone());
        let o = dedupvol(&["export", s(&vol), &small]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("less than the volume's logical size"), "{}", text(&o));
    }
}

struct Detach(String);
impl Drop for Detach {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn export_names_the_damaged_block_and_skip_bad_gets_the_rest_out() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = noise(4 << 20, 5);
    // Uncompressed, so each block is stored verbatim and can be found and damaged.
    let vol = volume_with(dir.path(), &data, &["--compression", "none"]);
    let img = std::fs::read(&vol).expect("read volume");
    let f = std::fs::OpenOptions::new().write(true).open(&vol).expect("open");
    let damaged = [5u64, 6, 300];
    for lba in damaged {
        let block = &data[lba as usize * 4096..(lba as usize + 1) * 4096];
        let at = img.windows(4096).step_by(4096).position(|w| w == block).expect("stored block") * 4096;
        f.write_all_at(&[img[at + 100] ^ 0xFF], (at + 100) as u64).expect("flip");
    }
    f.sync_all().expect("sync");
    let out = dir.path().join("out.raw");
    let o = dedupvol(&["export", s(&vol), s(&out)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    // Chunks are copied by several streams: either damaged chunk may be met first, but the
    // message names the block itself, not the start of its 1 MiB chunk.
    let t = text(&o);
    assert!(
        t.contains("offset 20480 (logical block 5)") || t.contains("offset 1228800 (logical block 300)"),
        "names the block, not its chunk: {t}"
    );
    assert!(text(&o).contains("--skip-bad"), "{}", text(&o));
    let o = dedupvol(&["export", s(&vol), s(&out), "--skip-bad"]);
    assert_eq!(o.status.code(), Some(1), "data was lost: exit 1: {}", text(&o));
    let t = text(&o);
    assert!(t.contains("3 unreadable blocks"), "{t}");
    assert!(t.contains("lost: offset 20480 length 8192") && t.contains("lost: offset 1228800 length 4096"), "{t}");
    let got = std::fs::read(&out).expect("read export");
    for i in 0..data.len() / 4096 {
        let (g, d) = (&got[i * 4096..(i + 1) * 4096], &data[i * 4096..(i + 1) * 4096]);
        if damaged.contains(&(i as u64)) {
            assert!(g.iter().all(|&b| b == 0), "lost block {i} is zeros");
        } else {
            assert!(g == d, "block {i} exported intact");
        }
    }
    // A clean volume exports with --skip-bad and exit 0.
    let clean = dir.path().join("clean");
    std::fs::create_dir(&clean).expect("mkdir");
    let vol2 = volume_with(&clean, &data[..1 << 20], &[]);
    let o = dedupvol(&["export", s(&vol2), "/dev/null", "--skip-bad"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

#[test]
fn sigterm_during_import_flushes_closes_and_says_where_to_resume() {
    let dir = tempfile::tempdir().expect("tmp");
    let vol = dir.path().join("v.img");
    assert!(dedupvol(&["format", s(&vol), "--logical-size", "64M", "--physical-size", "64M"]).status.success());
    let data = noise(8 << 20, 6);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupvol"))
        .args(["import", s(&vol), "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    // Returns once the pipe took it all: the importer has read all but at most a pipe
    // buffer, and then waits for more.
    stdin.write_all(&data[..4 << 20]).expect("feed");
    // SAFETY: kill on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let o = child.wait_with_output().expect("wait");
    drop(stdin);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(143), "{t}");
    assert!(t.contains("interrupted by SIGTERM") && t.contains("closed cleanly"), "{t}");
    let copied: u64 = t
        .split("--offset ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --offset to resume from: {t}"));
    assert!(copied > 0 && copied <= 4 << 20, "copied {copied}: {t}");
    assert!(t.contains(&format!("--input-offset {copied}")), "{t}");
    // What it says it copied is in the volume, and the volume is clean.
    let o = dedupvol(&["check", s(&vol)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = dedupvol(&["export", s(&vol), "-"]);
    assert!(o.stdout[..copied as usize] == data[..copied as usize], "the reported prefix is in the volume");
    // Resume with the whole input and the printed offsets.
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &data).expect("write");
    let off = copied.to_string();
    let o = dedupvol(&["import", s(&vol), s(&input), "--offset", &off, "--input-offset", &off]);
    assert!(o.status.success(), "{}", text(&o));
    let o = dedupvol(&["export", s(&vol), "-"]);
    assert!(o.stdout[..data.len()] == *data, "resumed import completes the copy");
}

#[test]
fn index_memory_the_machine_cannot_hold_is_refused_and_open_can_lower_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let vol = dir.path().join("v.img");
    // Twice this machine's memory: refused at format, and no file is left.
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok())
        .expect("MemTotal in /proc/meminfo");
    let too_much = format!("{}K", mem_kib * 2);
    let o =
        dedupvol(&["format", s(&vol), "--logical-size", "64M", "--physical-size", "64M", "--index-memory", &too_much]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("exceeds this machine's"), "{}", text(&o));
    assert!(!vol.exists(), "a refused format left a file");
    // A volume whose index a 3 GiB address space cannot hold (a 3 TiB window: 5.6 GB of
    // volume index, its chapter ring on a sparse metadata file): opening it there is a
    // clear error (exit 1), not an allocation abort (exit 134); --index-memory lowers it.
    let meta = dir.path().join("meta.img");
    std::fs::File::create(&meta).and_then(|f| f.set_len(40 << 30)).expect("sparse metadata file");
    let o = dedupvol(&[
        "format",
        s(&vol),
        "--logical-size",
        "64M",
        "--physical-size",
        "64M",
        "--meta-device",
        s(&meta),
        "--dedup-window",
        "3T",
        "--index-memory",
        "8G",
    ]);
    if !o.status.success() {
        eprintln!("SKIPPED the open half: this machine has less than 8 GiB ({})", text(&o));
        return;
    }
    let limited = |args: &str| {
        Command::new("sh")
            .args(["-c", &format!("ulimit -v 3000000; exec \"$0\" {args}"), env!("CARGO_BIN_EXE_dedupvol")])
            .output()
            .expect("sh")
    };
    let v = s(&vol);
    for cmd in ["info", "stats", "export"] {
        let extra = if cmd == "export" { " /dev/null" } else { "" };
        let o = limited(&format!("{cmd} {v}{extra}"));
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", text(&o));
        assert!(text(&o).contains("not enough memory") && text(&o).contains("--index-memory"), "{cmd}: {}", text(&o));
        let o = limited(&format!("{cmd} {v}{extra} --index-memory 64M"));
        assert_eq!(o.status.code(), Some(0), "{cmd} --index-memory 64M: {}", text(&o));
    }
    // serve: refused, then served with a smaller index (its readiness line on stdout).
    let o = limited(&format!("serve {v} --listen 127.0.0.1:0"));
    assert_eq!(o.status.code(), Some(1), "serve: {}", text(&o));
    assert!(text(&o).contains("not enough memory"), "serve: {}", text(&o));
    let mut server = Command::new("sh")
        .args([
            "-c",
            &format!("ulimit -v 3000000; exec \"$0\" serve {v} --listen 127.0.0.1:0 --index-memory 64M"),
            env!("CARGO_BIN_EXE_dedupvol"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve");
    let mut out = std::io::BufReader::new(server.stdout.take().expect("stdout"));
    let mut line = String::new();
    // The server prints its readiness line or exits (EOF): either way this returns.
    std::io::BufRead::read_line(&mut out, &mut line).expect("read");
    // SAFETY: kill on our own child's pid (sh exec'd the server).
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let st = server.wait().expect("wait");
    assert!(line.contains("serving"), "serve --index-memory 64M: {line:?}");
    assert!(st.success(), "serve stopped cleanly: {st:?}");
    let o = limited(&format!("check {v}"));
    assert_eq!(o.status.code(), Some(8), "check: {}", text(&o));
    let o = limited(&format!("check {v} --index-memory 64M"));
    assert_eq!(o.status.code(), Some(0), "check --index-memory 64M: {}", text(&o));
    // The failed opens wrote nothing: the volume is still clean and its index intact.
    let o = dedupvol(&["check", v]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

#[test]
fn a_directory_is_called_a_directory() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = s(dir.path());
    for args in [
        vec!["info", d],
        vec!["stats", d],
        vec!["check", d],
        vec!["check", d, "--repair"],
        vec!["import", d, "/dev/null"],
    ] {
        let o = dedupvol(&args);
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o).contains("is a directory") && !text(&o).contains("too small"), "{args:?}: {}", text(&o));
    }
    let vol = volume_with(dir.path(), &noise(4096, 7), &[]);
    for args in [vec!["export", s(&vol), d], vec!["import", s(&vol), d]] {
        let o = dedupvol(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("is a directory"), "{args:?}: {}", text(&o));
    }
}
