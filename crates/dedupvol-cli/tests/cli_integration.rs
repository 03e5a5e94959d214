//! How dedupvol fits into a system: shell completions and man pages generated from the
//! command line, the example service config parses, `serve` tells systemd it is ready
//! (sd_notify READY=1 on `NOTIFY_SOCKET`) and stopping, and its log lines carry a
//! timestamp, a level and one prefix.

mod nbd_common;
use nbd_common::*;
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn completions_and_man_pages_are_generated() {
    for shell in ["bash", "zsh", "fish"] {
        let out = run(Command::new(dedupvol()).args(["completions", shell]));
        assert!(out.contains("dedupvol") && out.contains("serve"), "{shell} completions:\n{out}");
    }
    let page = run(Command::new(dedupvol()).arg("man"));
    assert!(page.starts_with(".ie") || page.contains(".TH dedupvol"), "man page:\n{}", &page[..page.len().min(400)]);
    let dir = tempfile::tempdir().expect("tempdir");
    run(Command::new(dedupvol()).args(["man", "--out-dir"]).arg(dir.path()));
    let serve = std::fs::read_to_string(dir.path().join("dedupvol-serve.1")).expect("dedupvol-serve.1");
    assert!(serve.contains("tls\\-cert") || serve.contains("tls-cert"), "serve's page documents its options");
    assert!(dir.path().join("dedupvol.1").is_file());
    assert!(dir.path().join("dedupvol-format.1").is_file());
    let bad = Command::new(dedupvol()).args(["completions", "cmd.exe"]).output().expect("run");
    assert_eq!(bad.status.code(), Some(2), "an unknown shell is a usage error");
}

#[test]
fn the_example_service_config_is_accepted() {
    // The shipped example names /srv paths that do not exist here: serve must get past
    // parsing the file and fail on opening the volume, naming it.
    let cfg = concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/systemd/serve.toml");
    let out = Command::new(dedupvol()).args(["serve", "--config", cfg]).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/srv/dedupvol/vm1.img"), "{err}");
}

#[test]
fn serve_notifies_systemd_and_logs_with_timestamps_and_levels() {
    if !require_engine("serve_notifies_systemd", &["nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let vol = format_volume(dir.path(), "16M", "32M");
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("bind notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let sock = dir.path().join("nbd.sock");
    let log = dir.path().join("serve.log");
    let mut child = Command::new(dedupvol())
        .arg("serve")
        .arg(&vol)
        .arg("--socket")
        .arg(&sock)
        .args(["--cache-size", "16M"])
        .env("NOTIFY_SOCKET", &notify_path)
        .env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir.path()))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn serve");
    let mut buf = [0u8; 4096];
    let n = notify.recv(&mut buf).expect("a notification");
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.lines().any(|l| l == "READY=1"), "first notification: {msg:?}");
    assert!(msg.contains("STATUS=serving dedupvol"), "{msg:?}");
    // Ready means ready: a client connects at once.
    run(Command::new("nbdinfo").arg("--size").arg(format!("nbd+unix:///dedupvol?socket={}", sock.display())));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let n = notify.recv(&mut buf).expect("a stopping notification");
    assert_eq!(String::from_utf8_lossy(&buf[..n]).trim(), "STOPPING=1");
    assert!(child.wait().expect("wait").success(), "clean stop");
    let text = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 3, "{text}");
    for l in &lines {
        // 2026-11-25T01:02:03.456789Z  INFO dedupvol: ...
        let (stamp, rest) = l.split_once(' ').unwrap_or_else(|| panic!("no timestamp: {l:?}"));
        assert!(stamp.len() >= 20 && stamp.as_bytes()[4] == b'-' && stamp.contains('T'), "timestamp of {l:?}");
        let rest = rest.trim_start();
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].iter().any(|lv| rest.starts_with(&format!("{lv} dedupvol: "))),
            "level and prefix of {l:?}"
        );
    }
    assert!(text.contains("INFO dedupvol: connection 0 from unix accepted"), "connections are logged:\n{text}");
    assert!(text.contains("stopped after 1 connection(s)"), "{text}");
    // A level below info hides the info lines.
    let quiet = Command::new(dedupvol())
        .args(["serve", "--config", "/nonexistent.toml"])
        .env("DEDUPVOL_LOG", "verbose")
        .output()
        .expect("run");
    assert_eq!(quiet.status.code(), Some(2), "an unknown level is a usage error");
}
