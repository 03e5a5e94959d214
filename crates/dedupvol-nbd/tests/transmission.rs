//! Transmission behaviour: pipelined requests answered by cookie, the error table
//! (EINVAL / ENOSPC / EPERM), oversized and truncated requests, multi-conn visibility,
//! and a clean stop with requests in flight.

mod common;
use common::*;
use dedupvol_nbd::proto::*;
use std::collections::HashMap;
use std::io::Write;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn pipelined_writes_then_reads_round_trip() {
    let srv = TestServer::start(8 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    assert_eq!(go(&mut s, "vol").0, 8 << 20);
    const N: u64 = 64;
    const LEN: usize = 65536 + 123; // unaligned on purpose: minimum block size is 1
                                    // Send every write before reading any reply: the server must keep up with a pipeline
                                    // deeper than its queue (4) and its byte budget (1 MiB) without deadlocking.
    let writer = {
        let mut w = s.try_clone().unwrap();
        std::thread::spawn(move || {
            for i in 0..N {
                let fua = if i % 5 == 0 { CMD_FLAG_FUA } else { 0 };
                send_request(&mut w, CMD_WRITE, fua, 1000 + i, i * LEN as u64, LEN as u32, &pattern(i, LEN));
            }
        })
    };
    let mut cookies: Vec<u64> = (0..N)
        .map(|_| {
            let (e, c) = read_reply(&mut s);
            assert_eq!(e, 0);
            c
        })
        .collect();
    writer.join().unwrap();
    cookies.sort();
    assert_eq!(cookies, (1000..1000 + N).collect::<Vec<_>>());
    send_request(&mut s, CMD_FLUSH, 0, 1, 0, 0, &[]);
    assert_eq!(read_reply(&mut s), (0, 1));
    // Pipelined reads: replies may come back in any order; match them by cookie.
    for i in 0..N {
        send_request(&mut s, CMD_READ, 0, 5000 + i, i * LEN as u64, LEN as u32, &[]);
    }
    let mut got = HashMap::new();
    for _ in 0..N {
        let (e, c) = read_reply(&mut s);
        assert_eq!(e, 0);
        got.insert(c, read_n(&mut s, LEN));
    }
    for i in 0..N {
        assert!(got[&(5000 + i)] == pattern(i, LEN), "read {i} differs");
    }
    send_request(&mut s, CMD_DISC, 0, 0, 0, 0, &[]);
    assert!(is_closed(&mut s));
    srv.shutdown();
}

#[test]
fn trim_and_write_zeroes_read_back_zeros() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_WRITE, 0, 1, 0, 3 * 4096, &pattern(9, 3 * 4096));
    assert_eq!(read_reply(&mut s), (0, 1));
    send_request(&mut s, CMD_TRIM, CMD_FLAG_FUA, 2, 0, 4096, &[]);
    assert_eq!(read_reply(&mut s), (0, 2));
    send_request(&mut s, CMD_WRITE_ZEROES, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE, 3, 4096, 100, &[]);
    assert_eq!(read_reply(&mut s), (0, 3));
    send_request(&mut s, CMD_READ, 0, 4, 0, 3 * 4096, &[]);
    assert_eq!(read_reply(&mut s), (0, 4));
    let data = read_n(&mut s, 3 * 4096);
    let want = pattern(9, 3 * 4096);
    assert!(data[..4096 + 100].iter().all(|&b| b == 0));
    assert_eq!(&data[4096 + 100..], &want[4096 + 100..]);
    srv.shutdown();
}

#[test]
fn errors_follow_the_spec_and_keep_the_connection() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_READ, 0, 1, (1 << 20) - 10, 11, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 1), "read past the end");
    send_request(&mut s, CMD_WRITE, 0, 2, (1 << 20) - 10, 11, &[7u8; 11]);
    assert_eq!(read_reply(&mut s), (NBD_ENOSPC, 2), "write past the end");
    send_request(&mut s, CMD_TRIM, 0, 3, 1 << 20, 1, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 3), "trim past the end");
    send_request(&mut s, 77, 0, 4, 0, 0, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 4), "unknown command");
    send_request(&mut s, CMD_READ, CMD_FLAG_FUA, 5, 0, 1, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 5), "flag not valid for READ");
    send_request(&mut s, CMD_READ, 0, 6, 0, REQUEST_BYTES_MAX + 1, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 6), "oversized read");
    // After all that the connection is still in sync.
    send_request(&mut s, CMD_READ, 0, 7, 0, 4, &[]);
    assert_eq!(read_reply(&mut s), (0, 7));
    assert_eq!(read_n(&mut s, 4), vec![0; 4]);
    srv.shutdown();
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let srv = TestServer::start(1 << 20, true, 4);
    let mut s = connect_raw(&srv.socket);
    let (_, flags) = go(&mut s, "vol");
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    send_request(&mut s, CMD_WRITE, 0, 1, 0, 8, &[1u8; 8]);
    assert_eq!(read_reply(&mut s), (NBD_EPERM, 1));
    send_request(&mut s, CMD_TRIM, 0, 2, 0, 8, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EPERM, 2));
    send_request(&mut s, CMD_WRITE_ZEROES, 0, 3, 0, 8, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EPERM, 3));
    send_request(&mut s, CMD_READ, 0, 4, 0, 8, &[]);
    assert_eq!(read_reply(&mut s), (0, 4));
    assert_eq!(read_n(&mut s, 8), vec![0; 8]);
    srv.shutdown();
}

#[test]
fn bad_magic_and_oversized_write_close_only_that_connection() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    s.write_all(&[0xabu8; REQUEST_HEADER_BYTES]).unwrap();
    assert!(is_closed(&mut s));
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_WRITE, 0, 1, 0, REQUEST_BYTES_MAX + 1, &[]);
    assert!(is_closed(&mut s));
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_FLUSH, 0, 1, 0, 0, &[]);
    assert_eq!(read_reply(&mut s), (0, 1));
    srv.shutdown();
}

#[test]
fn disconnect_mid_payload_applies_nothing_and_spares_others() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut other = connect_raw(&srv.socket);
    go(&mut other, "vol");
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_WRITE, 0, 1, 0, 65536, &[0x55u8; 1000]);
    drop(s);
    send_request(&mut other, CMD_READ, 0, 2, 0, 65536, &[]);
    assert_eq!(read_reply(&mut other), (0, 2));
    assert!(read_n(&mut other, 65536).iter().all(|&b| b == 0), "a truncated write was applied");
    srv.shutdown();
}

#[test]
fn writes_on_one_connection_are_visible_and_flushed_from_another() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut a = connect_raw(&srv.socket);
    let (_, flags) = go(&mut a, "vol");
    assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
    let mut b = connect_raw(&srv.socket);
    go(&mut b, "vol");
    send_request(&mut a, CMD_WRITE, 0, 1, 4096, 4096, &pattern(3, 4096));
    assert_eq!(read_reply(&mut a), (0, 1));
    send_request(&mut b, CMD_FLUSH, 0, 2, 0, 0, &[]);
    assert_eq!(read_reply(&mut b), (0, 2));
    send_request(&mut b, CMD_READ, 0, 3, 4096, 4096, &[]);
    assert_eq!(read_reply(&mut b), (0, 3));
    assert_eq!(read_n(&mut b, 4096), pattern(3, 4096));
    srv.shutdown();
}

#[test]
fn stop_answers_requests_already_sent_then_returns() {
    let srv = TestServer::start(4 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    for i in 0..16u64 {
        send_request(&mut s, CMD_WRITE, 0, i, i * 65536, 65536, &pattern(i, 65536));
    }
    // Wait until the first reply proves the server is processing, then stop it.
    let mut replies = vec![read_reply(&mut s)];
    srv.stop.stop().unwrap();
    while replies.len() < 16 {
        replies.push(read_reply(&mut s));
    }
    assert!(replies.iter().all(|&(e, _)| e == 0));
    assert!(is_closed(&mut s));
    let summary = srv.shutdown();
    assert_eq!(summary.connections_served, 1);
}

/// Reads one structured chunk: (flags, type, cookie, payload).
fn read_chunk(s: &mut std::os::unix::net::UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let h = read_n(s, STRUCTURED_REPLY_HEADER_BYTES);
    assert_eq!(u32_at(&h, 0), STRUCTURED_REPLY_MAGIC);
    let len = u32_at(&h, 16) as usize;
    (u16_at(&h, 4), u16_at(&h, 6), u64_at(&h, 8), read_n(s, len))
}

#[test]
fn structured_replies_answer_reads_with_chunks() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut s).1, REP_ACK);
    send_option(&mut s, OPT_GO, &info_data("", &[]));
    while read_option_reply(&mut s).1 != REP_ACK {}

    // Writes still get simple replies (the spec allows either for non-reads).
    send_request(&mut s, CMD_WRITE, 0, 1, 8192, 5000, &pattern(5, 5000));
    assert_eq!(read_reply(&mut s), (0, 1));
    send_request(&mut s, CMD_READ, 0, 2, 8192, 5000, &[]);
    let (flags, kind, cookie, payload) = read_chunk(&mut s);
    assert_eq!((flags, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2));
    assert_eq!(u64_at(&payload, 0), 8192);
    assert_eq!(&payload[8..], &pattern(5, 5000)[..]);
    // Unwritten space comes back as a hole chunk.
    send_request(&mut s, CMD_READ, 0, 3, 65536, 65536, &[]);
    let (flags, kind, cookie, payload) = read_chunk(&mut s);
    assert_eq!((flags, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 3));
    assert_eq!((u64_at(&payload, 0), u32_at(&payload, 8)), (65536, 65536));
    // Errors on reads are error chunks, with a message.
    send_request(&mut s, CMD_READ, 0, 4, 1 << 20, 1, &[]);
    let (flags, kind, cookie, payload) = read_chunk(&mut s);
    assert_eq!((flags, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 4));
    assert_eq!(u32_at(&payload, 0), NBD_EINVAL);
    assert_eq!(u16_at(&payload, 4) as usize, payload.len() - 6);
    // A zero-length read is a lone NONE chunk.
    send_request(&mut s, CMD_READ, 0, 5, 0, 0, &[]);
    assert_eq!(read_chunk(&mut s), (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 5, vec![]));
    srv.shutdown();
}

/// Write replies are queued and sent by whichever worker holds the stream (`status`), so
/// under a deep pipeline of small writes mixed with reads on many workers, every request
/// must still get exactly one reply, and each read returns what its block's acknowledged
/// write left.
#[test]
fn queued_write_replies_are_never_lost_among_reads() {
    let limits = dedupvol_nbd::ConnectionLimits { workers: 8, ..test_limits() };
    let srv = TestServer::start_limits(8 << 20, false, 4, limits);
    let mut s = connect_raw(&srv.socket);
    assert_eq!(go(&mut s, "vol").0, 8 << 20);
    // A reply left behind in the queue fails the test instead of hanging it.
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    const N: u64 = 4000;
    const LEN: usize = 512;
    // Sends `reqs` from another thread while this one reads every reply; returns the
    // replies' cookies, checking each read's data.
    let round = |s: &mut std::os::unix::net::UnixStream, reqs: Vec<(u16, u64, u64)>| {
        let n = reqs.len();
        let mut w = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            for (kind, cookie, i) in reqs {
                let payload = if kind == CMD_WRITE { pattern(i, LEN) } else { Vec::new() };
                send_request(&mut w, kind, 0, cookie, i * LEN as u64, LEN as u32, &payload);
            }
        });
        let mut seen = std::collections::HashSet::new();
        for _ in 0..n {
            let h = read_n(s, SIMPLE_REPLY_BYTES);
            assert_eq!(u32_at(&h, 0), SIMPLE_REPLY_MAGIC);
            let (e, c) = (u32_at(&h, 4), u64_at(&h, 8));
            assert_eq!(e, 0, "request {c:#x} failed");
            if c >= READ_COOKIES {
                let i = c - READ_COOKIES;
                assert!(read_n(s, LEN) == pattern(i, LEN), "read of block {i} differs");
            }
            assert!(seen.insert(c), "request {c:#x} answered twice");
        }
        writer.join().unwrap();
    };
    const READ_COOKIES: u64 = 1 << 40;
    // Blocks 0..N written, every reply awaited; then reads of them interleaved with writes
    // of blocks N..2N, so write replies queue while read replies hold the stream.
    round(&mut s, (0..N).map(|i| (CMD_WRITE, 1 + i, i)).collect());
    round(&mut s, (0..N).flat_map(|i| [(CMD_READ, READ_COOKIES + i, i), (CMD_WRITE, 1 + N + i, N + i)]).collect());
    send_request(&mut s, CMD_DISC, 0, 0, 0, 0, &[]);
    assert!(is_closed(&mut s));
    srv.shutdown();
}

/// Write payloads are read into buffers their workers keep between requests: a short
/// write after a long one must write only its own bytes (nothing of the longer payload
/// left in the buffer past its end), and a payload over the kept size (4 MiB) gets a buffer
/// of its own. Sizes go up and down, pipelined, then the whole range is read back.
#[test]
fn write_payloads_of_every_size_write_only_their_own_bytes() {
    let srv = TestServer::start(8 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    assert_eq!(go(&mut s, "vol").0, 8 << 20);
    let mut expect = vec![0u8; 6 << 20];
    let writes: Vec<(u64, usize)> = vec![
        (0, 5 << 20),
        (4096, 7),
        (1 << 20, 300 << 10),
        (10, 1),
        (2 << 20, 65536 + 123),
        (3, 4 << 20),
        (5 << 20, 100),
        (777, 8192),
    ];
    for (k, &(off, len)) in writes.iter().enumerate() {
        let data = pattern(k as u64 + 77, len);
        send_request(&mut s, CMD_WRITE, 0, 100 + k as u64, off, len as u32, &data);
        expect[off as usize..off as usize + len].copy_from_slice(&data);
        // Replies come in any order; waiting for each keeps the expected content exact
        // whichever worker takes the next write.
        assert_eq!(read_reply(&mut s), (0, 100 + k as u64));
    }
    for (k, chunk) in expect.chunks(1 << 20).enumerate() {
        send_request(&mut s, CMD_READ, 0, 900 + k as u64, (k << 20) as u64, chunk.len() as u32, &[]);
        assert_eq!(read_reply(&mut s), (0, 900 + k as u64));
        assert!(read_n(&mut s, chunk.len()) == chunk, "MiB {k} differs");
    }
    send_request(&mut s, CMD_DISC, 0, 0, 0, 0, &[]);
    assert!(is_closed(&mut s));
    srv.shutdown();
}
