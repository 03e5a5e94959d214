//! Shared helpers for the real-client NBD tests (`nbd_*.rs`): find client tools (skipping
//! loudly when one is missing), format a volume with the built `dedupvol`, start
//! `dedupvol serve` and wait on its readiness line (never a sleep), stop it by signal.
//!
//! Set `DEDUPVOL_NBD_TEST_IN_MEMORY=1` to serve a RAM disk instead of a volume (protocol
//! debugging only; tests that need the engine's state skip themselves loudly then).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long the server may take to print its readiness line (opening replays the journal).
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a clean shutdown may take.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(60);

pub fn dedupvol() -> &'static str {
    env!("CARGO_BIN_EXE_dedupvol")
}

pub fn in_memory() -> bool {
    std::env::var_os("DEDUPVOL_NBD_TEST_IN_MEMORY").is_some_and(|v| v == "1")
}

/// Checks that every tool is on PATH (where the tests will run it from); prints a loud
/// skip line when one is absent.
/// Like `require`, and also skips loudly in in-memory mode, for tests that need the engine.
pub fn require_engine(test: &str, tools: &[&str]) -> bool {
    if !require(test, tools) {
        return false;
    }
    if in_memory() {
        eprintln!("SKIPPED: {test}: needs the engine (in-memory mode) — this test did NOT run");
        return false;
    }
    true
}

pub fn require(test: &str, tools: &[&str]) -> bool {
    for t in tools {
        if which(t).is_none() {
            eprintln!(
                "SKIPPED: {test}: `{t}` not installed or not on PATH (see scripts/apt-packages.txt) — this test did NOT run"
            );
            return false;
        }
    }
    true
}

pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(tool)).find(|p| p.is_file())
}

/// Runs a command, panicking with its output when it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Formats a volume file `dir/vol.img`.
pub fn format_volume(dir: &Path, logical: &str, physical: &str) -> PathBuf {
    let path = dir.join("vol.img");
    if !in_memory() {
        run(Command::new(dedupvol()).arg("format").arg(&path).args([
            "--logical-size",
            logical,
            "--physical-size",
            physical,
        ]));
    }
    path
}

pub struct ServerProc {
    pub child: Option<Child>,
    /// `nbd+unix:///dedupvol?socket=...` or `nbd://127.0.0.1:PORT/dedupvol`.
    pub uri: String,
    pub socket: Option<PathBuf>,
    pub tcp: Option<String>,
    pub ready_line: String,
    pub size: u64,
    /// The server's stdout lines after the readiness line.
    pub lines: mpsc::Receiver<String>,
}

/// The runtime directory (admin sockets) the tests' servers and `dedupvol stats` use:
/// one per test directory, so tests never see each other's servers.
pub fn runtime_dir(dir: &Path) -> PathBuf {
    dir.join("run")
}

impl ServerProc {
    /// Starts `dedupvol serve` on a Unix socket in `dir` (or TCP port 0 when `tcp`).
    pub fn start(vol: &Path, dir: &Path, tcp: bool, extra: &[&str]) -> ServerProc {
        let mut cmd = Command::new(dedupvol());
        cmd.arg("serve").arg(vol).args(extra).env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir));
        let socket = dir.join("nbd.sock");
        if tcp {
            cmd.args(["--listen", "127.0.0.1:0"]);
        } else {
            cmd.arg("--socket").arg(&socket);
        }
        if in_memory() {
            cmd.args(["--in-memory", "64M"]);
        }
        // The server inherits signal dispositions: a test run under `nohup` would start it
        // with SIGHUP ignored, which it rightly keeps ignoring. Servers here get the default,
        // as from a terminal (the nohup case has its own test).
        // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::signal(libc::SIGHUP, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn dedupvol serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Every line goes to the test; draining keeps the server from blocking on a
            // full pipe even when nobody asks for the later lines.
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let line = match rx.recv_timeout(READY_TIMEOUT) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait();
                panic!("dedupvol serve printed no readiness line within {READY_TIMEOUT:?} (exit: {status:?})");
            }
        };
        assert!(line.starts_with("dedupvol: serving "), "unexpected first line: {line:?}");
        let size = line
            .split('(')
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no size in readiness line {line:?}"));
        let addr = line.rsplit(" on ").next().expect("address").to_string();
        let (uri, sock, tcp_addr) = if tcp {
            (format!("nbd://{addr}/dedupvol"), None, Some(addr))
        } else {
            assert_eq!(addr, format!("unix:{}", socket.display()));
            (format!("nbd+unix:///dedupvol?socket={}", socket.display()), Some(socket), None)
        };
        ServerProc { child: Some(child), uri, socket: sock, tcp: tcp_addr, ready_line: line, size, lines: rx }
    }

    /// The next stdout line after the readiness line (e.g. the metrics address).
    pub fn next_line(&self) -> String {
        self.lines.recv_timeout(READY_TIMEOUT).expect("the server printed no further line")
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn stop(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        wait_timeout(&mut child, STOP_TIMEOUT)
    }

    /// SIGKILL: a crash.
    pub fn kill9(mut self) {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Each thread of `pid`: its name, state, the kernel function it waits in and its system
/// call (from /proc), so a hang that only shows on another machine says where it hangs.
fn thread_states(pid: i32) -> String {
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default().trim().to_string();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return "(no /proc)".into() };
    let mut out = String::new();
    for t in tasks.flatten() {
        let tid = t.file_name().to_string_lossy().to_string();
        let dir = format!("/proc/{pid}/task/{tid}");
        let state =
            read(format!("{dir}/stat")).split(") ").nth(1).and_then(|r| r.split(' ').next()).unwrap_or("?").to_string();
        out += &format!(
            "  {tid} {:<16} state {state} wchan {} syscall {}\n",
            read(format!("{dir}/comm")),
            read(format!("{dir}/wchan")),
            read(format!("{dir}/syscall")),
        );
    }
    out
}

/// Waits for `child` to exit; kills it and panics after `limit`, naming where each of its
/// threads waits.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> ExitStatus {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(limit) {
            Ok(status) => status.expect("wait"),
            Err(_) => {
                let threads = thread_states(pid);
                // SAFETY: kill(2) on our own child's pid, which has not been reaped.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("process {pid} did not exit within {limit:?}; its threads:\n{threads}");
            }
        }
    })
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Test data with known reduction: `dup_every`-th 64 KiB piece repeats an earlier one,
/// half of each 4 KiB block is compressible text, the rest pseudo-random.
pub fn make_data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(len);
    let piece = 65536;
    while out.len() < len {
        let n = out.len() / piece;
        if n >= 4 && n % 3 == 0 {
            let src = (next() as usize % (n / 2)) * piece;
            let copy: Vec<u8> = out[src..src + piece].to_vec();
            out.extend_from_slice(&copy);
            continue;
        }
        for _ in 0..piece / 4096 {
            for i in 0..2048 {
                out.push(b"the quick brown fox jumps over the lazy dog "[i % 44]);
            }
            for _ in 0..256 {
                out.extend_from_slice(&next().to_le_bytes());
            }
        }
    }
    out.truncate(len);
    out
}

pub fn assert_same(a: &[u8], b: &[u8], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
        panic!("{what}: first difference at byte {i}");
    }
}

/// A loop mount of a file that nbdfuse exposes, and the nbdfuse process: undone on drop
/// (lazily, so a failed test never leaves a busy mount behind).
pub struct Mounts {
    pub loop_mnt: PathBuf,
    pub fuse_dir: PathBuf,
    pub nbdfuse: Option<Child>,
}

impl Mounts {
    /// Unmounts the file system (its data reaches the volume), failing the test if it can't.
    pub fn umount_loop(&self) {
        run(Command::new("umount").arg(&self.loop_mnt));
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.loop_mnt).stderr(Stdio::null()).status();
        let _ = Command::new("fusermount3").arg("-u").arg(&self.fuse_dir).stderr(Stdio::null()).status();
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits, bounded, for a file to appear (nbdfuse signals readiness by writing its pid file).
pub fn wait_for_file(p: &Path, limit: Duration) {
    let start = std::time::Instant::now();
    while !p.exists() {
        assert!(start.elapsed() < limit, "{} did not appear within {limit:?}", p.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One HTTP GET of `path` at `addr` (the metrics endpoint): status line, lower-cased
/// headers, body.
pub fn http_get(addr: &str, path: &str) -> (String, String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    std::io::Write::write_fmt(&mut s, format_args!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n")).unwrap();
    let mut all = String::new();
    std::io::Read::read_to_string(&mut s, &mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").expect("http head");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_string(), headers.to_lowercase(), body.to_string())
}
