//! `dedupvol serve` start-up and shutdown around other processes: signals, a client that
//! stopped reading, a socket path already in use, and the connection limit.
//!
//! Regressions pinned here (each test names its bug):
//! - SIGHUP killed `serve` without closing the volume, so the next open replayed the journal.
//! - SIGTERM with a client that stopped reading took ~119 s: shutdown waited for a reply
//!   write bounded by two 60 s send timeouts.
//! - A second `serve --socket S` on a live socket took it over (clients reached the wrong
//!   volume) and stopping the first server deleted the second's socket.
//! - A client beyond `--connections-max` was closed without a word.

mod nbd_common;
use nbd_common::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The `clean` byte of the newest superblock copy (docs/format.md: copies in blocks 0 and 1;
/// generation at offset 32, clean at 45).
fn clean_flag(vol: &Path) -> u8 {
    let mut f = std::fs::File::open(vol).unwrap();
    let mut b = vec![0u8; 8192];
    f.read_exact(&mut b).unwrap();
    let copies = [&b[..4096], &b[4096..]];
    let newest = copies
        .iter()
        .filter(|c| &c[..8] == b"DEDUPVOL")
        .max_by_key(|c| u64::from_le_bytes(c[32..40].try_into().unwrap()))
        .expect("no superblock");
    newest[45]
}

fn signal(srv: &ServerProc, sig: i32) {
    let pid = srv.child.as_ref().expect("running").id() as i32;
    // SAFETY: kill(2) on our own child's pid, not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

fn wait_exit(srv: &mut ServerProc, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let start = Instant::now();
    let mut child = srv.child.take().expect("running");
    let status = wait_timeout(&mut child, limit);
    (status, start.elapsed())
}

/// A minimal NBD client: fixed-newstyle greeting, then GO for the default export without
/// structured replies. Returns the connection, or the server's option error text.
fn nbd_go(socket: &Path) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    s.write_all(&1u32.to_be_bytes()).unwrap(); // NBD_FLAG_C_FIXED_NEWSTYLE
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&7u32.to_be_bytes()); // NBD_OPT_GO
    opt.extend_from_slice(&6u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes()); // empty name: the default export
    opt.extend_from_slice(&0u16.to_be_bytes()); // no info requests
    s.write_all(&opt).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("option reply");
        let reply = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut data).unwrap();
        match reply {
            1 => return Ok(s), // NBD_REP_ACK
            3 => continue,     // NBD_REP_INFO
            r if r & (1 << 31) != 0 => return Err(String::from_utf8_lossy(&data).into_owned()),
            r => panic!("unexpected option reply {r:#x}"),
        }
    }
}

/// Sends `n` reads of 1 MiB and never reads the replies.
fn stop_reading(s: &mut UnixStream, n: u64) {
    for cookie in 0..n {
        let mut r = Vec::new();
        r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes()); // NBD_CMD_READ
        r.extend_from_slice(&cookie.to_be_bytes());
        r.extend_from_slice(&0u64.to_be_bytes());
        r.extend_from_slice(&(1u32 << 20).to_be_bytes());
        s.write_all(&r).unwrap();
    }
}

#[test]
fn sighup_closes_the_volume_cleanly() {
    let test = "sighup_closes_the_volume_cleanly";
    if !require_engine(test, &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let mut srv = ServerProc::start(&vol, dir.path(), false, &[]);
    assert_eq!(clean_flag(&vol), 0, "an open volume must be marked not clean (else this test proves nothing)");
    signal(&srv, libc::SIGHUP);
    let (status, _) = wait_exit(&mut srv, STOP_TIMEOUT);
    assert!(status.success(), "serve exited with {status} on SIGHUP");
    assert_eq!(clean_flag(&vol), 1, "SIGHUP left the volume unclosed: its next open replays the journal");
}

#[test]
fn sighup_ignored_by_the_parent_stays_ignored() {
    // `nohup dedupvol serve …` asks for a server that outlives the terminal: SIGHUP handling
    // must not undo an inherited SIG_IGN.
    let test = "sighup_ignored_by_the_parent_stays_ignored";
    if !require_engine(test, &[]) {
        return;
    }
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let socket = dir.path().join("nbd.sock");
    let mut cmd = Command::new(dedupvol());
    cmd.arg("serve").arg(&vol).arg("--socket").arg(&socket).stdout(std::process::Stdio::piped());
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut ready = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut ready).unwrap();
    assert!(ready.starts_with("dedupvol: serving"), "{ready:?}");
    // SAFETY: kill(2) on our own child's pid, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    // Still serving: a client completes a handshake after the hangup.
    drop(nbd_go(&socket).expect("GO after SIGHUP"));
    assert!(child.try_wait().unwrap().is_none(), "serve exited on a SIGHUP it was started ignoring");
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(wait_timeout(&mut child, STOP_TIMEOUT).success());
    assert_eq!(clean_flag(&vol), 1);
}

#[test]
fn sigterm_does_not_wait_for_a_client_that_stopped_reading() {
    let test = "sigterm_does_not_wait_for_a_client_that_stopped_reading";
    if !require_engine(test, &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let mut srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let socket = srv.socket.clone().expect("unix socket");
    let mut client = nbd_go(&socket).expect("GO");
    stop_reading(&mut client, 32);
    // Make sure the server is stuck writing before the signal: it must not have hung up yet.
    client.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    signal(&srv, libc::SIGTERM);
    let (status, took) = wait_exit(&mut srv, STOP_TIMEOUT);
    assert!(status.success(), "serve exited with {status}");
    // The reply timeout is 60 s; shutdown gives a stalled reply 2 s.
    assert!(took < Duration::from_secs(15), "SIGTERM took {took:?} with a client that stopped reading");
    assert_eq!(clean_flag(&vol), 1, "the volume was not closed cleanly");
    drop(client);
}

#[test]
fn a_socket_in_use_is_refused_and_kept() {
    let test = "a_socket_in_use_is_refused_and_kept";
    if !require_engine(test, &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let other_dir = dir.path().join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let other = format_volume(&other_dir, "32M", "64M");
    let first = ServerProc::start(&vol, dir.path(), false, &[]);
    let socket = first.socket.clone().expect("unix socket");
    let out = Command::new(dedupvol()).arg("serve").arg(&other).arg("--socket").arg(&socket).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "second server on a live socket: {stderr}");
    assert!(stderr.contains("is in use by a running server"), "{stderr}");
    assert!(out.stdout.is_empty(), "the second server printed a readiness line");
    // The socket still leads to the first server's volume (64 MiB, not 32).
    drop(nbd_go(&socket).expect("the first server lost its socket"));
    assert_eq!(clean_flag(&other), 1, "the refused server opened (and left open) its volume");
    assert!(first.stop().success());
    assert!(!socket.exists(), "the first server left its own socket behind");
}

#[test]
fn a_client_over_the_connection_limit_is_told_why() {
    let test = "a_client_over_the_connection_limit_is_told_why";
    if !require(test, &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "64M", "128M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--connections-max", "1"]);
    let socket = srv.socket.clone().expect("unix socket");
    let first = nbd_go(&socket).expect("first client");
    let refused = nbd_go(&socket).expect_err("second client admitted over --connections-max 1");
    assert_eq!(refused, "server at its connection limit (1)");
    // A real client shows the reason too.
    if which("qemu-io").is_some() {
        let out = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 4k"])
            .arg(format!("nbd+unix:///dedupvol?socket={}", socket.display()))
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "qemu-io was admitted: {text}");
        assert!(text.contains("server at its connection limit (1)"), "qemu-io did not show the reason: {text}");
    } else {
        eprintln!("note: {test}: qemu-io not installed; checked with the raw client only");
    }
    drop(first);
    assert!(srv.stop().success());
}
