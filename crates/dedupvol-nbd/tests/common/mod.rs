//! A minimal raw NBD client and an in-process server over a RAM disk, for protocol tests
//! that must not depend on the engine or on installed client tools.
#![allow(dead_code)]

use dedupvol_nbd::proto::*;
use dedupvol_nbd::{
    ConnectionLimits, ExportConfig, ListenAddr, MemBackend, RunSummary, Server, ServerConfig, StopHandle,
};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

pub struct TestServer {
    pub socket: PathBuf,
    pub stop: StopHandle,
    pub thread: Option<JoinHandle<std::io::Result<RunSummary>>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn start(size: u64, read_only: bool, connections_max: usize) -> TestServer {
        Self::start_with(size, read_only, connections_max, std::time::Duration::from_secs(30))
    }

    pub fn start_with(
        size: u64,
        read_only: bool,
        connections_max: usize,
        handshake_timeout: std::time::Duration,
    ) -> TestServer {
        Self::start_limits(size, read_only, connections_max, ConnectionLimits { handshake_timeout, ..test_limits() })
    }

    pub fn start_limits(size: u64, read_only: bool, connections_max: usize, limits: ConnectionLimits) -> TestServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nbd.sock");
        let config = ServerConfig { connections_max, limits, tls: None };
        let export = ExportConfig { name: "vol".into(), description: None, read_only };
        let server = Server::bind(&ListenAddr::Unix(socket.clone()), config).expect("bind");
        let stop = server.stop_handle().expect("stop handle");
        let backend = Arc::new(MemBackend::new(size, false).expect("mem backend"));
        let thread = std::thread::spawn(move || server.run(export, backend));
        TestServer { socket, stop, thread: Some(thread), _dir: dir }
    }

    pub fn shutdown(mut self) -> RunSummary {
        // May fail when the server already stopped (its end of the stop pipe is closed).
        let _ = self.stop.stop();
        self.thread.take().expect("thread").join().expect("server thread panicked").expect("server run")
    }
}

/// The small per-connection bounds the protocol tests run with.
pub fn test_limits() -> ConnectionLimits {
    ConnectionLimits {
        workers: 3,
        inflight_bytes_max: 1 << 20,
        handshake_timeout: std::time::Duration::from_secs(30),
        ..ConnectionLimits::default()
    }
}

pub fn connect_raw(socket: &PathBuf) -> UnixStream {
    let s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).expect("timeout");
    s
}

pub fn read_n(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).expect("read");
    b
}

pub fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().unwrap())
}
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Reads the greeting and sends client flags.
pub fn greet(s: &mut UnixStream, client_flags: u32) {
    let g = read_n(s, 18);
    assert_eq!(u64_at(&g, 0), NBDMAGIC);
    assert_eq!(u64_at(&g, 8), IHAVEOPT);
    assert_eq!(u16_at(&g, 16), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    s.write_all(&client_flags.to_be_bytes()).unwrap();
}

pub fn send_option(s: &mut UnixStream, option: u32, data: &[u8]) {
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
}

/// Reads one option reply: (option, reply type, data).
pub fn read_option_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let h = read_n(s, 20);
    assert_eq!(u64_at(&h, 0), OPTION_REPLY_MAGIC);
    let len = u32_at(&h, 16) as usize;
    (u32_at(&h, 8), u32_at(&h, 12), read_n(s, len))
}

pub fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        d.extend_from_slice(&r.to_be_bytes());
    }
    d
}

/// Full GO handshake; returns (size, transmission flags).
pub fn go(s: &mut UnixStream, name: &str) -> (u64, u16) {
    greet(s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(s, OPT_GO, &info_data(name, &[INFO_BLOCK_SIZE]));
    let mut export = None;
    loop {
        let (opt, rep, data) = read_option_reply(s);
        assert_eq!(opt, OPT_GO);
        match rep {
            REP_INFO if u16_at(&data, 0) == INFO_EXPORT => export = Some((u64_at(&data, 2), u16_at(&data, 10))),
            REP_INFO => {}
            REP_ACK => return export.expect("GO succeeded without NBD_INFO_EXPORT"),
            other => panic!("GO failed with reply {other:#x}: {}", String::from_utf8_lossy(&data)),
        }
    }
}

pub fn send_request(s: &mut UnixStream, kind: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
    let mut b = encode_request(&Request { flags, kind, cookie, offset, len }).to_vec();
    b.extend_from_slice(payload);
    s.write_all(&b).unwrap();
}

/// Reads a simple reply header: (error, cookie).
pub fn read_reply(s: &mut UnixStream) -> (u32, u64) {
    let h = read_n(s, SIMPLE_REPLY_BYTES);
    assert_eq!(u32_at(&h, 0), SIMPLE_REPLY_MAGIC);
    (u32_at(&h, 4), u64_at(&h, 8))
}

/// True when the server has closed the connection (EOF on read).
pub fn is_closed(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        // A read timeout means the server kept the connection open: not closed.
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}
