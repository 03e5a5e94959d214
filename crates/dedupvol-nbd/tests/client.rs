//! The NBD client against the in-process server (a RAM disk): data written comes back,
//! flush works, an unknown export and out-of-range or read-only requests are typed errors;
//! and against a scripted server: a command error is reported with its code, and a reply
//! out of step leaves the connection unusable instead of misreading later replies.

mod common;
use common::TestServer;
use dedupvol_nbd::client::{ClientError, NbdAddress, NbdClient, NbdUri};
use dedupvol_nbd::proto::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

fn uri(server: &TestServer, export: &str) -> NbdUri {
    NbdUri { address: NbdAddress::Unix(server.socket.clone()), export: export.into() }
}

#[test]
fn round_trip_flush_and_typed_errors() {
    let server = TestServer::start(1 << 20, false, 4);
    let mut c = NbdClient::connect(&uri(&server, "vol"), TIMEOUT).expect("connect");
    assert_eq!(c.size_bytes(), 1 << 20);
    assert!(!c.read_only());
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    c.write(4096, &data).expect("write");
    c.flush().expect("flush");
    let mut back = vec![0u8; 8192];
    c.read(4096, &mut back).expect("read");
    assert_eq!(back, data);
    // A second connection sees the first one's writes (one export, one disk).
    let mut d = NbdClient::connect(&uri(&server, "vol"), TIMEOUT).expect("second connection");
    let mut again = vec![0u8; 8192];
    d.read(4096, &mut again).expect("read");
    assert_eq!(again, data);
    let e = c.read((1 << 20) - 4096, &mut back).expect_err("past the end");
    assert!(matches!(e, ClientError::Rejected { command: "READ", .. }), "{e}");
    // The connection is still usable after a rejected request.
    c.read(0, &mut back).expect("read after a rejection");
    c.disconnect().expect("disconnect");
    d.disconnect().expect("disconnect");
    let e = NbdClient::connect(&uri(&server, "nope"), TIMEOUT).expect_err("unknown export");
    assert!(matches!(e, ClientError::Refused { reply: REP_ERR_UNKNOWN, .. }), "{e}");
    server.shutdown();

    let ro = TestServer::start(1 << 20, true, 4);
    let mut c = NbdClient::connect(&uri(&ro, "vol"), TIMEOUT).expect("connect");
    assert!(c.read_only());
    let e = c.write(0, &[1u8; 4096]).expect_err("read-only export");
    assert!(matches!(e, ClientError::Rejected { command: "WRITE", .. }), "{e}");
    ro.shutdown();
}

/// How the scripted server answers a request: (error, cookie override, magic override).
type Script = fn(&Request) -> (u32, Option<u64>, Option<u32>);

/// Serves one client: the handshake (GO answered with a 1 MiB export), then answers each
/// request as `reply` says.
fn scripted_server(reply: Script) -> (tempfile::TempDir, NbdUri) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.write_all(&encode_greeting()).expect("greeting");
        let mut head = [0u8; 4 + OPTION_HEADER_BYTES];
        s.read_exact(&mut head).expect("client flags and option header");
        let len = u32::from_be_bytes([head[16], head[17], head[18], head[19]]) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data).expect("option data");
        s.write_all(&encode_option_reply(OPT_GO, REP_INFO, &encode_info_export(1 << 20, TFLAG_HAS_FLAGS)))
            .expect("info");
        s.write_all(&encode_option_reply(OPT_GO, REP_ACK, &[])).expect("ack");
        loop {
            let mut h = [0u8; REQUEST_HEADER_BYTES];
            if s.read_exact(&mut h).is_err() {
                return;
            }
            let r = parse_request(&h).expect("request");
            if r.kind == CMD_DISC {
                return;
            }
            if r.kind == CMD_WRITE {
                let mut payload = vec![0u8; r.len as usize];
                s.read_exact(&mut payload).expect("payload");
            }
            let (error, cookie, magic) = reply(&r);
            let mut out = encode_simple_reply(error, cookie.unwrap_or(r.cookie)).to_vec();
            if let Some(m) = magic {
                out[0..4].copy_from_slice(&m.to_be_bytes());
            }
            if error == 0 && r.kind == CMD_READ {
                out.extend(std::iter::repeat_n(0xABu8, r.len as usize));
            }
            if s.write_all(&out).is_err() {
                return;
            }
        }
    });
    let uri = NbdUri { address: NbdAddress::Unix(path), export: String::new() };
    (dir, uri)
}

#[test]
fn a_server_error_is_reported_with_its_code() {
    // Reads at offset 0 fail with EIO; the rest succeed.
    let (_dir, uri) = scripted_server(|r| (if r.kind == CMD_READ && r.offset == 0 { NBD_EIO } else { 0 }, None, None));
    let mut c = NbdClient::connect(&uri, TIMEOUT).expect("connect");
    let mut buf = vec![0u8; 4096];
    let e = c.read(0, &mut buf).expect_err("EIO");
    assert!(matches!(e, ClientError::Command { command: "READ", offset: 0, len: 4096, error: NBD_EIO }), "{e}");
    assert!(e.to_string().contains("EIO"), "{e}");
    // A failed read carries no data: the next reply is read in step.
    c.read(4096, &mut buf).expect("next read");
    assert!(buf.iter().all(|&b| b == 0xAB));
    c.write(8192, &buf).expect("write");
}

#[test]
fn a_reply_out_of_step_breaks_the_connection() {
    let (_dir, uri) = scripted_server(|r| (0, Some(r.cookie + 100), None));
    let mut c = NbdClient::connect(&uri, TIMEOUT).expect("connect");
    let e = c.write(0, &[0u8; 4096]).expect_err("wrong cookie");
    assert!(matches!(e, ClientError::Protocol { .. }), "{e}");
    let e = c.write(0, &[0u8; 4096]).expect_err("broken");
    assert!(matches!(e, ClientError::Broken), "{e}");

    let (_dir2, uri2) = scripted_server(|_| (0, None, Some(STRUCTURED_REPLY_MAGIC)));
    let mut c = NbdClient::connect(&uri2, TIMEOUT).expect("connect");
    let e = c.flush().map(|_| ()).and_then(|_| c.write(0, &[0u8; 512])).expect_err("bad magic");
    assert!(e.to_string().contains("bad reply magic"), "{e}");
}
