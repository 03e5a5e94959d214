//! Handshake behaviour against the spec: GO/INFO answers, LIST, ABORT, EXPORT_NAME
//! fallback with and without NO_ZEROES, unknown options and unknown exports.

mod common;
use common::*;
use dedupvol_nbd::proto::*;

#[test]
fn go_reports_size_flags_and_block_sizes() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE);
    send_option(&mut s, OPT_INFO, &info_data("vol", &[INFO_BLOCK_SIZE, INFO_NAME]));
    let mut seen = Vec::new();
    loop {
        let (opt, rep, data) = read_option_reply(&mut s);
        assert_eq!(opt, OPT_INFO);
        if rep == REP_ACK {
            break;
        }
        assert_eq!(rep, REP_INFO);
        match u16_at(&data, 0) {
            INFO_EXPORT => {
                assert_eq!(u64_at(&data, 2), 1 << 20);
                let f = u16_at(&data, 10);
                for bit in [
                    TFLAG_HAS_FLAGS,
                    TFLAG_SEND_FLUSH,
                    TFLAG_SEND_FUA,
                    TFLAG_SEND_TRIM,
                    TFLAG_SEND_WRITE_ZEROES,
                    TFLAG_CAN_MULTI_CONN,
                ] {
                    assert_ne!(f & bit, 0, "flag {bit:#x} missing from {f:#x}");
                }
                assert_eq!(f & TFLAG_READ_ONLY, 0);
            }
            INFO_BLOCK_SIZE => {
                assert_eq!((u32_at(&data, 2), u32_at(&data, 6), u32_at(&data, 10)), (1, 4096, 32 << 20));
            }
            INFO_NAME => assert_eq!(&data[2..], b"vol"),
            other => panic!("unexpected info {other}"),
        }
        seen.push(u16_at(&data, 0));
    }
    seen.sort();
    assert_eq!(seen, vec![INFO_EXPORT, INFO_NAME, INFO_BLOCK_SIZE]);
    // INFO leaves us in negotiation: GO with the default name still works.
    send_option(&mut s, OPT_GO, &info_data("", &[]));
    let (_, rep, data) = read_option_reply(&mut s);
    assert_eq!((rep, u16_at(&data, 0)), (REP_INFO, INFO_EXPORT));
    srv.shutdown();
}

#[test]
fn unknown_option_and_unknown_export_are_errors_not_disconnects() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE);
    send_option(&mut s, 5 /* STARTTLS */, &[]);
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_UNSUP);
    // Understood, but refused: metadata contexts need structured replies first.
    send_option(&mut s, 10 /* SET_META_CONTEXT */, &[0; 8]);
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_INVALID);
    send_option(&mut s, OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_INVALID);
    send_option(&mut s, 0xdead, b"junk");
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_UNSUP);
    send_option(&mut s, OPT_GO, &info_data("nope", &[]));
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_UNKNOWN);
    send_option(&mut s, OPT_GO, &[0, 0, 0, 9, b'x']);
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_INVALID);
    send_option(&mut s, OPT_LIST, &[]);
    let (_, rep, data) = read_option_reply(&mut s);
    assert_eq!(rep, REP_SERVER);
    assert_eq!(&data[4..], b"vol");
    assert_eq!(read_option_reply(&mut s).1, REP_ACK);
    send_option(&mut s, OPT_ABORT, &[]);
    assert_eq!(read_option_reply(&mut s).1, REP_ACK);
    assert!(is_closed(&mut s));
    srv.shutdown();
}

#[test]
fn export_name_fallback_honours_no_zeroes() {
    let srv = TestServer::start(1 << 20, false, 4);
    for (flags, reply_len) in [(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 10), (FLAG_C_FIXED_NEWSTYLE, 134)] {
        let mut s = connect_raw(&srv.socket);
        greet(&mut s, flags);
        send_option(&mut s, OPT_EXPORT_NAME, b"vol");
        let r = read_n(&mut s, reply_len);
        assert_eq!(u64_at(&r, 0), 1 << 20);
        assert!(r[10..].iter().all(|&b| b == 0));
        // Transmission works right after the reply: a flush answers cleanly.
        send_request(&mut s, CMD_FLUSH, 0, 42, 0, 0, &[]);
        assert_eq!(read_reply(&mut s), (0, 42));
    }
    // An unknown name under EXPORT_NAME cannot be answered with an error: the server closes.
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE);
    send_option(&mut s, OPT_EXPORT_NAME, b"other");
    assert!(is_closed(&mut s));
    srv.shutdown();
}

#[test]
fn unknown_client_flags_and_bad_option_magic_close_the_connection() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, 1 << 7);
    assert!(is_closed(&mut s));
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE);
    std::io::Write::write_all(&mut s, &[0u8; 16]).unwrap();
    assert!(is_closed(&mut s));
    srv.shutdown();
}

/// Regression: a client over `--connections-max` was closed at accept without a word, so
/// clients reported a bare "connection reset" or "unexpected end of file" and the operator
/// had to read the server's log. The spec lets a server error options but not hang up
/// unasked: the refused client now gets the greeting and `NBD_REP_ERR_POLICY` with the
/// reason for every option, then is closed.
#[test]
fn connections_beyond_the_maximum_are_refused_with_a_reason() {
    let srv = TestServer::start(1 << 20, false, 1);
    let mut a = connect_raw(&srv.socket);
    go(&mut a, "vol");
    let mut b = connect_raw(&srv.socket);
    greet(&mut b, FLAG_C_FIXED_NEWSTYLE);
    send_option(&mut b, OPT_GO, &info_data("vol", &[]));
    let (opt, rep, msg) = read_option_reply(&mut b);
    assert_eq!((opt, rep), (OPT_GO, REP_ERR_POLICY));
    assert_eq!(String::from_utf8_lossy(&msg), "server at its connection limit (1)");
    // Still refused on a retry; ABORT is acknowledged and ends it.
    send_option(&mut b, OPT_LIST, &[]);
    assert_eq!(read_option_reply(&mut b).1, REP_ERR_POLICY);
    send_option(&mut b, OPT_ABORT, &[]);
    assert_eq!(read_option_reply(&mut b).1, REP_ACK);
    assert!(is_closed(&mut b));
    // EXPORT_NAME cannot carry an error: the refused client is closed.
    let mut c = connect_raw(&srv.socket);
    greet(&mut c, FLAG_C_FIXED_NEWSTYLE);
    send_option(&mut c, OPT_EXPORT_NAME, b"vol");
    assert!(is_closed(&mut c));
    // The first client was never disturbed.
    send_request(&mut a, CMD_FLUSH, 0, 1, 0, 0, &[]);
    assert_eq!(read_reply(&mut a), (0, 1));
    drop(a);
    let summary = srv.shutdown();
    assert_eq!(summary.connections_refused, 2);
}

#[test]
fn a_refused_client_that_says_nothing_does_not_delay_shutdown() {
    let srv = TestServer::start(1 << 20, false, 1);
    let mut a = connect_raw(&srv.socket);
    go(&mut a, "vol");
    let mut b = connect_raw(&srv.socket);
    let _greeting = read_n(&mut b, 18);
    let start = std::time::Instant::now();
    let summary = srv.shutdown();
    assert!(start.elapsed() < std::time::Duration::from_secs(3), "shutdown waited for the refused client");
    assert_eq!(summary.connections_refused, 1);
}

#[test]
fn a_silent_client_is_dropped_after_the_handshake_timeout_and_frees_its_slot() {
    let srv = TestServer::start_with(1 << 20, false, 1, std::time::Duration::from_millis(300));
    let mut silent = connect_raw(&srv.socket);
    let _greeting = read_n(&mut silent, 18);
    // Say nothing: the server must give up on us, and the slot must become free.
    let start = std::time::Instant::now();
    assert!(is_closed(&mut silent));
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    drop(silent);
    // The slot is released once the connection thread ends; retry until it is, bounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        // A refused client gets a greeting too; only GO tells a free slot from a refusal.
        let mut s = connect_raw(&srv.socket);
        greet(&mut s, FLAG_C_FIXED_NEWSTYLE);
        send_option(&mut s, OPT_GO, &info_data("vol", &[]));
        if read_option_reply(&mut s).1 != REP_ERR_POLICY {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "slot never freed");
    }
    srv.shutdown();
}
