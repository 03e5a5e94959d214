//! Unix socket paths are never taken over.
//!
//! Regression: `Listener::bind` removed any socket file at its path, live or not, so a
//! second `dedupvol serve --socket S` took over the socket of a running server (new clients
//! reached the wrong volume), and when the first server stopped it deleted the second's
//! socket file. Now a socket that accepts connections is refused, only a stale one is
//! replaced, and a listener removes the path on drop only while it is still its own file.

use dedupvol_nbd::{ListenAddr, Listener};
use std::os::unix::net::{UnixListener, UnixStream};

#[test]
fn a_live_socket_is_refused_and_left_working() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let first = Listener::bind(&ListenAddr::Unix(path.clone())).expect("first bind");
    let err = Listener::bind(&ListenAddr::Unix(path.clone())).expect_err("second bind of a live socket");
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    assert!(err.to_string().contains("is in use by a running server"), "{err}");
    // The first listener still owns the path: a client reaches it.
    UnixStream::connect(&path).expect("connect to the first server");
    assert!(first.accept().is_ok(), "the first listener lost its socket");
}

#[test]
fn a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    // A socket file nobody listens on any more (a server that was killed).
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let l = Listener::bind(&ListenAddr::Unix(path.clone())).expect("bind over a stale socket");
    UnixStream::connect(&path).expect("connect");
    drop(l);
    assert!(!path.exists(), "the listener did not remove its own socket file");
}

#[test]
fn a_listener_does_not_remove_a_socket_that_is_no_longer_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let first = Listener::bind(&ListenAddr::Unix(path.clone())).unwrap();
    // Someone removed the first server's socket and a second server bound the path.
    std::fs::remove_file(&path).unwrap();
    let second = Listener::bind(&ListenAddr::Unix(path.clone())).unwrap();
    drop(first);
    assert!(path.exists(), "stopping the first server deleted the second server's socket");
    UnixStream::connect(&path).expect("the second server is still reachable");
    drop(second);
}

#[test]
fn a_file_that_is_not_a_socket_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    std::fs::write(&path, b"precious").unwrap();
    let err = Listener::bind(&ListenAddr::Unix(path.clone())).expect_err("bind over a regular file");
    assert!(err.to_string().contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
}
