//! Every subcommand walked through bad input: missing files, directories, files that are not
//! volumes, zero / huge / malformed sizes, unknown flags, read-only files, a volume another
//! process is serving, and a closed stdout. Each case asserts the exit code (0 success,
//! 1 operation error, 2 usage error; `check`: 8 operation error), a piece of the message,
//! and that nothing panicked.
//!
//! Regressions pinned here, as they were found:
//! - `info`, `stats`, `stats --json`, `check --json`, `estimate` and `gen` panicked with
//!   "failed printing to stdout: Broken pipe" when piped into `head`.
//! - A missing file printed its OS error twice ("…: No such file or directory (os error 2):
//!   No such file or directory (os error 2)").
//! - `info` showed Rust names (`Lz4`, `Hash`, `Async`), `serve` showed `Tcp("…")`/`Unix("…")`.
//! - A lock conflict did not say which process held the volume.
//! - Argument mistakes found after parsing exited 1 in some commands and 2 in others.
//! - `stats` of an empty volume printed "reduction ratio 0.00:1".
//! - `gen --json` printed `working_set_blocks: 18446744073709551615` for "all blocks".
//! - `gen --size 16P` wrote until the disk was full and left the partial file; `bench
//!   --size 16P` aborted allocating its data.
//! - `bench --no-disk` said it was measuring the disk.

mod nbd_common;
use nbd_common::{dedupvol, ServerProc};
use std::ffi::OsStr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Exit codes.
const OK: i32 = 0;
const FAIL: i32 = 1;
const USAGE: i32 = 2;
/// `check`: fsck's "operational error".
const CHECK_FAIL: i32 = 8;

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    args: String,
}

fn finish(args: String, out: Output) -> Run {
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        args,
    }
}

fn show<S: AsRef<OsStr>>(args: &[S]) -> String {
    args.iter().map(|a| a.as_ref().to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
}

/// Runs `dedupvol ARGS` in `dir`.
fn dv<S: AsRef<OsStr>>(dir: &Path, args: &[S]) -> Run {
    let out = Command::new(dedupvol()).current_dir(dir).args(args).stdin(Stdio::null()).output().unwrap();
    finish(show(args), out)
}

/// Runs `dedupvol ARGS` with its stdout a pipe whose reader is already gone: every write to
/// stdout fails with EPIPE, as under `| head` once head has exited.
fn dv_closed_stdout<S: AsRef<OsStr>>(dir: &Path, args: &[S]) -> Run {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    let out = Command::new(dedupvol())
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    finish(format!("{} > closed pipe", show(args)), out)
}

impl Run {
    /// Exit code `code`, `needle` in stderr (case-insensitive), no panic.
    fn expect(&self, code: i32, needle: &str) -> &Self {
        assert!(!self.stderr.contains("panicked"), "`dedupvol {}` panicked:\n{}", self.args, self.stderr);
        assert_eq!(
            self.code,
            Some(code),
            "`dedupvol {}` exit code\nstdout:\n{}\nstderr:\n{}",
            self.args,
            self.stdout,
            self.stderr
        );
        assert!(
            self.stderr.to_lowercase().contains(&needle.to_lowercase()),
            "`dedupvol {}`: stderr lacks {needle:?}:\n{}",
            self.args,
            self.stderr
        );
        self.no_repeated_os_error()
    }

    /// Success, and `needle` on stdout.
    fn expect_ok(&self, needle: &str) -> &Self {
        self.expect(OK, "");
        assert!(self.stdout.contains(needle), "`dedupvol {}`: stdout lacks {needle:?}:\n{}", self.args, self.stdout);
        self
    }

    /// No OS error text appears twice on one line.
    fn no_repeated_os_error(&self) -> &Self {
        for line in self.stderr.lines() {
            if let Some(at) = line.find(" (os error ") {
                let start = line[..at].rfind(": ").map_or(0, |i| i + 2);
                let text = &line[start..at];
                assert!(
                    line.matches(&format!("{text} (os error")).count() == 1,
                    "`dedupvol {}` repeats an OS error: {line}",
                    self.args
                );
            }
        }
        self
    }

    /// No Rust Debug formatting of our types in any output.
    fn no_debug_names(&self) -> &Self {
        for bad in ["Lz4", "Zstd", "Hash)", "Bytes)", "Async", "Sync\n", "Tcp(", "Unix(", "Some("] {
            assert!(
                !self.stdout.contains(bad) && !self.stderr.contains(bad),
                "`dedupvol {}` shows a Rust name {bad:?}:\n{}{}",
                self.args,
                self.stdout,
                self.stderr
            );
        }
        self
    }
}

/// A scratch directory with a volume, a file that is not one, an empty file and a directory.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let s = Scratch { dir };
        dv(s.path(), &["format", "vol.img", "--logical-size", "64M", "--physical-size", "128M"]).expect_ok("formatted");
        let junk: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        std::fs::write(s.p("junk.bin"), &junk).unwrap();
        std::fs::write(s.p("empty.bin"), b"").unwrap();
        std::fs::create_dir(s.p("adir")).unwrap();
        s
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn p(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    fn run(&self, args: &[&str]) -> Run {
        dv(self.path(), args)
    }
}

#[test]
fn format_bad_input() {
    let s = Scratch::new();
    s.run(&["format", "missing.img", "--logical-size", "64M"]).expect(FAIL, "does not exist");
    s.run(&["format", "adir", "--logical-size", "64M"]).expect(FAIL, "is a directory");
    s.run(&["format", "junk.bin", "--logical-size", "64M"]).expect(FAIL, "--force");
    s.run(&["format", "vol.img", "--logical-size", "64M"]).expect(FAIL, "--force");
    s.run(&["format", "new.img", "--logical-size", "0", "--physical-size", "64M"]).expect(USAGE, "logical size 0");
    s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "0"]).expect(USAGE, "--physical-size");
    s.run(&["format", "new.img", "--logical-size", "abc", "--physical-size", "64M"]).expect(USAGE, "abc");
    s.run(&["format", "new.img", "--logical-size", "99999999999P", "--physical-size", "64M"])
        .expect(USAGE, "overflows");
    s.run(&["format", "new.img", "--logical-size", "16P", "--physical-size", "64M"]).expect(USAGE, "maximum");
    s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "16P"]).expect(FAIL, "new.img");
    s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "64M", "--slab-size", "3M"])
        .expect(USAGE, "slab size");
    s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "64M", "--compression", "lz5"])
        .expect(USAGE, "compression");
    for bad in ["zstd:0", "zstd:20", "zstd:fast", "lz4:3"] {
        s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "64M", "--compression", bad])
            .expect(USAGE, "level");
    }
    s.run(&["format", "new.img", "--logical-size", "64M", "--physical-size", "64M", "--dedup", "maybe"])
        .expect(USAGE, "--dedup");
    s.run(&["format", "new.img", "--logical-size", "64M", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["format", "new.img"]).expect(USAGE, "--logical-size");
    assert!(!s.p("new.img").exists(), "a failed format left new.img behind");
}

#[test]
fn info_bad_input() {
    let s = Scratch::new();
    s.run(&["info", "missing.img"]).expect(FAIL, "no such file");
    s.run(&["info", "adir"]).expect(FAIL, "is a directory");
    s.run(&["info", "junk.bin"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["info", "empty.bin"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["info", "vol.img", "--io", "sideways"]).expect(USAGE, "sideways");
    s.run(&["info", "vol.img", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["info"]).expect(USAGE, "<PATH>");
    let r = s.run(&["info", "vol.img"]);
    r.expect_ok("compression     zstd:1").no_debug_names();
    assert!(r.stdout.contains("verify hash") && r.stdout.contains("write policy    async"), "{}", r.stdout);
}

#[test]
fn import_bad_input() {
    let s = Scratch::new();
    s.run(&["import", "vol.img", "missing.bin"]).expect(FAIL, "no such file");
    s.run(&["import", "vol.img", "adir"]).expect(FAIL, "is a directory");
    s.run(&["import", "adir", "junk.bin"]).expect(FAIL, "is a directory");
    s.run(&["import", "missing.img", "junk.bin"]).expect(FAIL, "no such file");
    s.run(&["import", "junk.bin", "empty.bin"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["import", "vol.img", "junk.bin", "--offset", "abc"]).expect(USAGE, "abc");
    s.run(&["import", "vol.img", "junk.bin", "--offset", "16P"]).expect(FAIL, "does not fit");
    s.run(&["import", "vol.img", "junk.bin", "--offset", "64M"]).expect(FAIL, "does not fit");
    s.run(&["import", "vol.img", "vol.img"]).expect(FAIL, "own device");
    s.run(&["import", "vol.img", "junk.bin", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["import", "vol.img"]).expect(USAGE, "<FILE>");
    // Zeros store nothing: there is no ratio to print, not "0.00".
    std::fs::write(s.p("zeros.bin"), vec![0u8; 1 << 20]).unwrap();
    s.run(&["import", "vol.img", "zeros.bin"]).expect_ok("(ratio -)");
    s.run(&["import", "vol.img", "junk.bin"]).expect_ok("imported");
}

#[test]
fn export_bad_input() {
    let s = Scratch::new();
    s.run(&["export", "missing.img", "out.raw"]).expect(FAIL, "no such file");
    s.run(&["export", "adir", "out.raw"]).expect(FAIL, "is a directory");
    s.run(&["export", "junk.bin", "out.raw"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["export", "vol.img", "adir"]).expect(FAIL, "is a directory");
    s.run(&["export", "vol.img", "no/such/dir/out.raw"]).expect(FAIL, "no such file");
    s.run(&["export", "vol.img", "vol.img"]).expect(FAIL, "own device");
    assert_eq!(s.run(&["info", "vol.img"]).code, Some(OK), "export onto its own volume destroyed it");
    s.run(&["export", "vol.img", "out.raw", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["export", "vol.img", "out.raw"]).expect_ok("exported");
}

#[test]
fn stats_bad_input() {
    let s = Scratch::new();
    s.run(&["stats", "missing.img"]).expect(FAIL, "no such file");
    s.run(&["stats", "adir"]).expect(FAIL, "is a directory");
    s.run(&["stats", "junk.bin"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["stats", "vol.img", "--bogus"]).expect(USAGE, "--bogus");
    // An empty volume has no reduction ratio.
    let r = s.run(&["stats", "vol.img"]);
    r.expect_ok("reduction ratio");
    let line = r.stdout.lines().find(|l| l.starts_with("reduction ratio")).unwrap();
    assert_eq!(line.split_whitespace().last(), Some("-"), "{line}");
}

#[test]
fn check_bad_input() {
    let s = Scratch::new();
    s.run(&["check", "missing.img"]).expect(CHECK_FAIL, "no such file");
    s.run(&["check", "adir"]).expect(CHECK_FAIL, "is a directory");
    s.run(&["check", "junk.bin"]).expect(CHECK_FAIL, "not a dedupvol volume");
    s.run(&["check", "empty.bin"]).expect(CHECK_FAIL, "not a dedupvol volume");
    s.run(&["check", "vol.img", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["check", "vol.img"]).expect_ok("clean");
}

#[test]
fn serve_bad_input() {
    let s = Scratch::new();
    s.run(&["serve", "missing.img"]).expect(FAIL, "no such file");
    s.run(&["serve", "adir"]).expect(FAIL, "is a directory");
    s.run(&["serve", "junk.bin"]).expect(FAIL, "not a dedupvol volume");
    s.run(&["serve", "vol.img", "--connections-max", "0"]).expect(USAGE, "--connections-max");
    s.run(&["serve", "vol.img", "--connections-max", "-1"]).expect(USAGE, "-1");
    s.run(&["serve", "vol.img", "--workers-per-connection", "0"]).expect(USAGE, "--workers-per-connection");
    s.run(&["serve", "vol.img", "--cache-size", "lots"]).expect(USAGE, "--cache-size");
    s.run(&["serve", "vol.img", "--listen", "nowhere"]).expect(FAIL, "listening on nowhere").no_debug_names();
    s.run(&["serve", "vol.img", "--socket", "no/such/dir/s.sock"]).expect(FAIL, "listening on unix:").no_debug_names();
    s.run(&["serve", "vol.img", "--socket", "junk.bin"]).expect(FAIL, "not a socket");
    s.run(&["serve", "vol.img", "--socket", "s.sock", "--listen", "127.0.0.1:0"]).expect(USAGE, "--listen");
    s.run(&["serve", "vol.img", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["serve"]).expect(USAGE, "no volume to serve");
    s.run(&["serve", "vol.img", "vol.img"]).expect(USAGE, "two exports are named");
    s.run(&["serve", "a=vol.img", "b=vol.img", "--export-name", "x"]).expect(USAGE, "--export-name");
    s.run(&["serve", "vol.img", "--read-only-export", "nope"]).expect(USAGE, "no export of that name");
    s.run(&["serve", "--config", "no/such.toml"]).expect(FAIL, "no/such.toml");
    s.run(&["serve", "--config", "junk.bin"]).expect(FAIL, "--config junk.bin");
    s.run(&["serve", "vol.img", "--tls-cert", "c.pem", "--tls-key", "k.pem"]).expect(USAGE, "c.pem");
    s.run(&["serve", "vol.img", "--tls-cert", "c.pem"]).expect(USAGE, "--tls-key");
    s.run(&["serve", "vol.img", "--tls", "require"]).expect(USAGE, "--tls-cert");
    s.run(&["serve", "vol.img", "--listen", "0.0.0.0:0"]).expect(USAGE, "needs TLS");
    assert_eq!(std::fs::read(s.p("junk.bin")).unwrap().len(), 1 << 20, "serve replaced a regular file");
    // None of the failures left the volume unclosed.
    s.run(&["check", "vol.img"]).expect_ok("clean");
}

#[test]
fn bench_bad_input() {
    let s = Scratch::new();
    let dir = s.path().to_str().unwrap();
    let b = |extra: &[&str]| {
        let mut a = vec!["bench", "--dir", dir, "--no-baseline", "--no-disk"];
        a.extend_from_slice(extra);
        s.run(&a)
    };
    b(&["--threads", "0"]).expect(USAGE, "--threads");
    b(&["--size", "abc"]).expect(USAGE, "--size abc");
    b(&["--size", "0"]).expect(USAGE, "--size");
    b(&["--size", "16P"]).expect(FAIL, "in memory");
    b(&["--size", "99999999999P"]).expect(USAGE, "overflows");
    b(&["--request-size", "3K"]).expect(USAGE, "--request-size");
    b(&["--dup", "200"]).expect(USAGE, "--dup 200");
    b(&["--mode", "ingest"]).expect(USAGE, "--file");
    b(&["--mode", "sideways"]).expect(USAGE, "sideways");
    b(&["--compression", "lz5"]).expect(USAGE, "--compression");
    b(&["--mode", "scaling", "--workers", "1"]).expect(USAGE, "--workers 2..8");
    b(&["--mode", "scaling", "--rounds", "0"]).expect(USAGE, "--rounds 1..20");
    b(&["--mode", "scaling", "--json"]).expect(USAGE, "no --json");
    b(&["--bogus"]).expect(USAGE, "--bogus");
    s.run(&["bench", "--dir", "missing-dir"]).expect(FAIL, "not a directory");
    b(&["--mode", "ingest", "--file", "missing.bin", "--size", "4M"]).expect(FAIL, "missing.bin");
    // --volume never destroys a volume or data without --force.
    b(&["--volume", "vol.img", "--size", "4M"]).expect(FAIL, "--force");
    b(&["--volume", "junk.bin", "--size", "4M"]).expect(FAIL, "--force");
    s.run(&["info", "vol.img"]).expect_ok("logical size");
    // --no-disk does not claim to measure the disk.
    let r = b(&["--mode", "primitives", "--size", "4M"]);
    r.expect_ok("dedupvol bench");
    assert!(!r.stderr.contains("measuring the disk"), "{}", r.stderr);
    assert!(!r.stdout.contains("disk seq MB/s"), "{}", r.stdout);
    r.no_debug_names();
    // The scaling tables (every core, then confined to as many cores as workers): a row
    // per worker count, each beside the machine's limit. Confined rows need the cores.
    let r = b(&["--mode", "scaling", "--size", "8M", "--request-size", "1M", "--workers", "2", "--rounds", "1"]);
    r.expect_ok("vs 1 worker");
    assert!(r.stdout.contains("machine limit per round"), "{}", r.stdout);
    assert!(r.stdout.contains("workers with every core"), "{}", r.stdout);
    assert!(r.stdout.contains("workers confined to as many cores"), "{}", r.stdout);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with("1 ") || l.starts_with("2 ")).collect();
    assert_eq!(rows.len(), if cores >= 2 { 4 } else { 3 }, "{}", r.stdout);
    assert!(rows[0].contains("1.00x"), "{}", r.stdout);
    assert!(rows[2].contains("1.00x"), "{}", r.stdout);
}

#[test]
fn gen_bad_input() {
    let s = Scratch::new();
    s.run(&["gen", "--size", "abc", "-o", "g.bin", "--dup", "10"]).expect(USAGE, "--size abc");
    s.run(&["gen", "--size", "0", "-o", "g.bin", "--dup", "10"]).expect(USAGE, "--size");
    s.run(&["gen", "--size", "16P", "-o", "g.bin", "--dup", "10"]).expect(FAIL, "free");
    assert!(!s.p("g.bin").exists(), "gen left a file for a size it refused");
    s.run(&["gen", "--size", "1M", "-o", "adir", "--dup", "10"]).expect(FAIL, "is a directory");
    s.run(&["gen", "--size", "1M", "-o", "no/such/dir/g.bin", "--dup", "10"]).expect(FAIL, "no such file");
    s.run(&["gen", "--size", "1M", "-o", "g.bin", "--dup", "150"]).expect(USAGE, "--dup 150");
    s.run(&["gen", "--size", "1M", "-o", "g.bin"]).expect(USAGE, "--preset");
    s.run(&["gen", "--size", "1M", "-o", "g.bin", "--preset", "bogus"]).expect(USAGE, "bogus");
    s.run(&["gen", "--size", "1M", "-o", "g.bin", "--dup", "10", "--working-set", "1K"]).expect(USAGE, "--working-set");
    s.run(&["gen", "--size", "1M", "--dup", "10"]).expect(USAGE, "--output");
    s.run(&["gen", "--size", "1M", "-o", "g.bin", "--dup", "10", "--bogus"]).expect(USAGE, "--bogus");
    // JSON: an unbounded working set is null, not u64::MAX.
    let r = s.run(&["gen", "--size", "1M", "-o", "g.bin", "--dup", "10", "--json"]);
    r.expect_ok("working_set_blocks");
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).expect("gen --json output");
    assert!(v["data"]["working_set_blocks"].is_null(), "{}", r.stdout);
    assert!(!r.stdout.contains(&u64::MAX.to_string()), "{}", r.stdout);
    let r = s.run(&["gen", "--size", "1M", "-o", "g.bin", "--dup", "10", "--working-set", "64K", "--json"]);
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).expect("gen --json output");
    assert_eq!(v["data"]["working_set_blocks"], 16, "{}", r.stdout);
}

#[test]
fn estimate_bad_input() {
    let s = Scratch::new();
    s.run(&["estimate", "missing.bin"]).expect(FAIL, "no such file");
    s.run(&["estimate", "adir"]).expect(FAIL, "is a directory");
    s.run(&["estimate", "junk.bin", "--chunk-size", "3K"]).expect(USAGE, "--chunk-size");
    s.run(&["estimate", "junk.bin", "--chunk-size", "abc"]).expect(USAGE, "abc");
    s.run(&["estimate", "junk.bin", "--bogus"]).expect(USAGE, "--bogus");
    s.run(&["estimate"]).expect(USAGE, "<PATHS>");
    s.run(&["estimate", "empty.bin"]).expect_ok("scanned");
    s.run(&["estimate", "junk.bin", "--json"]).expect_ok("\"estimate\"");
}

/// Makes `path` unwritable even for root (`chattr +i`; root ignores mode bits) and undoes
/// it on drop, so the temporary directory can be removed.
struct ReadOnly(PathBuf);

impl ReadOnly {
    fn make(path: &Path) -> Option<ReadOnly> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).ok()?;
            return Some(ReadOnly(path.to_path_buf()));
        }
        let ok = Command::new("chattr").arg("+i").arg(path).status().is_ok_and(|s| s.success());
        ok.then(|| ReadOnly(path.to_path_buf()))
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o644));
    }
}

#[test]
fn read_only_files() {
    let test = "read_only_files";
    let s = Scratch::new();
    std::fs::write(s.p("out.raw"), b"old").unwrap();
    let guards: Option<Vec<ReadOnly>> =
        ["vol.img", "junk.bin", "out.raw"].iter().map(|f| ReadOnly::make(&s.p(f))).collect();
    let Some(_guards) = guards else {
        eprintln!(
            "SKIPPED: {test}: cannot make a file read-only here (root without chattr +i) — this test did NOT run"
        );
        return;
    };
    // Reading a read-only volume works.
    s.run(&["info", "vol.img"]).expect_ok("logical size");
    s.run(&["stats", "vol.img"]).expect_ok("logical size");
    s.run(&["check", "vol.img"]).expect_ok("clean");
    s.run(&["export", "vol.img", "copy.raw"]).expect_ok("exported");
    s.run(&["estimate", "junk.bin"]).expect_ok("scanned");
    // Writing one fails with the reason.
    let denied = |r: Run| {
        r.expect(FAIL, "");
        let e = r.stderr.to_lowercase();
        assert!(e.contains("permission denied") || e.contains("operation not permitted"), "{}: {}", r.args, r.stderr);
    };
    denied(s.run(&["import", "vol.img", "junk.bin"]));
    denied(s.run(&["format", "vol.img", "--logical-size", "64M", "--force"]));
    denied(s.run(&["serve", "vol.img", "--socket", "s.sock"]));
    denied(s.run(&["export", "vol.img", "out.raw"]));
    denied(s.run(&["gen", "--size", "1M", "-o", "out.raw", "--dup", "10"]));
    let r = s.run(&["check", "vol.img", "--repair"]);
    r.expect(CHECK_FAIL, "");
    // A read-only server of it works.
    let srv = ServerProc::start(&s.p("vol.img"), s.path(), false, &["--read-only"]);
    assert!(srv.stop().success());
}

#[test]
fn a_served_volume_is_refused_by_every_command_naming_the_server() {
    let s = Scratch::new();
    let srv = ServerProc::start(&s.p("vol.img"), s.path(), false, &[]);
    let pid = srv.child.as_ref().unwrap().id();
    let held = format!("held by process {pid} (");
    let locked = |r: Run, code: i32| {
        r.expect(code, "is in use by another process");
        assert!(r.stderr.contains(&held), "`{}` does not name the server (pid {pid}):\n{}", r.args, r.stderr);
    };
    locked(s.run(&["info", "vol.img"]), FAIL);
    locked(s.run(&["stats", "vol.img"]), FAIL);
    locked(s.run(&["stats", "vol.img", "--json"]), FAIL);
    locked(s.run(&["export", "vol.img", "out.raw"]), FAIL);
    locked(s.run(&["import", "vol.img", "junk.bin"]), FAIL);
    locked(s.run(&["check", "vol.img"]), CHECK_FAIL);
    locked(s.run(&["check", "vol.img", "--repair"]), CHECK_FAIL);
    locked(s.run(&["format", "vol.img", "--logical-size", "64M", "--force"]), FAIL);
    locked(s.run(&["serve", "vol.img", "--socket", "second.sock"]), FAIL);
    // bench reports a scenario's engine error in its table (stdout), and fails.
    let dir = s.path().to_str().unwrap();
    let size_before = std::fs::metadata(s.p("vol.img")).unwrap().len();
    let r =
        s.run(&["bench", "--volume", "vol.img", "--force", "--size", "4M", "--no-baseline", "--no-disk", "--dir", dir]);
    r.expect(FAIL, "");
    assert!(r.stdout.contains("is in use by another process") && r.stdout.contains(&held), "{}", r.stdout);
    // Regression: format and bench extended the file before taking the lock, growing a
    // served volume's file under its server.
    assert_eq!(std::fs::metadata(s.p("vol.img")).unwrap().len(), size_before, "the served volume's file changed size");
    assert!(srv.stop().success(), "the server did not survive the attempts");
    s.run(&["check", "vol.img"]).expect_ok("clean");
}

#[test]
fn a_closed_stdout_is_a_quiet_exit_for_every_command() {
    let s = Scratch::new();
    let dir = s.path().to_str().unwrap().to_string();
    let cases: Vec<Vec<&str>> = vec![
        vec!["info", "vol.img"],
        vec!["stats", "vol.img"],
        vec!["stats", "vol.img", "--json"],
        vec!["check", "vol.img"],
        vec!["check", "vol.img", "--json"],
        vec!["estimate", "junk.bin"],
        vec!["estimate", "junk.bin", "--json"],
        vec!["gen", "--size", "1M", "-o", "g.bin", "--dup", "10"],
        vec!["gen", "--size", "1M", "-o", "g.bin", "--dup", "10", "--json"],
        vec!["format", "new.img", "--logical-size", "64M", "--physical-size", "128M"],
        vec!["import", "vol.img", "junk.bin"],
        vec!["export", "vol.img", "out.raw"],
        vec!["bench", "--mode", "primitives", "--size", "4M", "--no-disk", "--no-baseline", "--dir", &dir],
        vec!["bench", "--mode", "primitives", "--size", "4M", "--no-disk", "--no-baseline", "--json", "--dir", &dir],
        vec!["trace", "generate", "t.fiu", "--ops", "2000", "--blocks", "256"],
        vec!["trace", "stats", "t.fiu"],
        vec!["trace", "stats", "t.fiu", "--json"],
        vec!["replay", "t.fiu", "--target", "file:g.bin"],
        vec!["replay", "t.fiu", "--target", "file:g.bin", "--json"],
        vec!["--help"],
    ];
    for args in &cases {
        let r = dv_closed_stdout(s.path(), args);
        r.expect(OK, "");
        assert!(!r.stderr.to_lowercase().contains("broken pipe"), "`{}`:\n{}", r.args, r.stderr);
    }
    // The commands did their work although nobody read what they printed.
    s.run(&["info", "new.img"]).expect_ok("logical size");
    s.run(&["check", "vol.img"]).expect_ok("clean");
    assert_eq!(std::fs::metadata(s.p("g.bin")).unwrap().len(), 1 << 20);
    assert_eq!(std::fs::read_to_string(s.p("t.fiu")).unwrap().lines().count(), 2000);
}

#[test]
fn serve_with_a_closed_stdout_and_stderr_keeps_serving() {
    // Regression: `serve`'s log lines used eprintln!, which panics when stderr is a pipe
    // nobody reads (`dedupvol serve 2>&1 | head -1`): the first refused client killed the
    // server without closing its volume.
    let s = Scratch::new();
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    let socket = s.p("s.sock");
    let mut child = Command::new(dedupvol())
        .current_dir(s.path())
        .args(["serve", "vol.img", "--socket", "s.sock", "--connections-max", "1"])
        .stdout(Stdio::from(write_end.try_clone().unwrap()))
        .stderr(Stdio::from(write_end))
        .spawn()
        .unwrap();
    // No readiness line can be read: wait on the socket itself (bounded).
    let deadline = std::time::Instant::now() + nbd_common::READY_TIMEOUT;
    let first = loop {
        if let Ok(c) = std::os::unix::net::UnixStream::connect(&socket) {
            break c;
        }
        assert!(child.try_wait().unwrap().is_none(), "serve exited although only its output was closed");
        assert!(std::time::Instant::now() < deadline, "serve never listened");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Wait for the greeting: the first client holds the only slot.
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut &first, &mut greeting).unwrap();
    // Over the limit: the server logs the refusal (to the dead stderr) and answers it.
    let mut second = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    std::io::Read::read_exact(&mut second, &mut greeting).unwrap();
    drop(second);
    drop(first);
    // SAFETY: kill(2) on our own child's pid, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = nbd_common::wait_timeout(&mut child, nbd_common::STOP_TIMEOUT);
    assert!(status.success(), "serve exited with {status}");
    s.run(&["check", "vol.img"]).expect_ok("clean");
}
