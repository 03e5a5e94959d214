//! A client that stops reading its replies.
//!
//! Regression: the server bounded reply writes with `SO_SNDTIMEO` and `write_all`. The
//! kernel's send timeout restarts with every `send`, and a blocked `send` that had queued
//! part of its buffer returns that part when the timeout fires; `write_all` then waited a
//! whole timeout again. A client that stopped reading was dropped after ~122 s instead of
//! the documented 60 s (`reply_write_timeout`), and SIGTERM with such a client connected
//! took ~119 s, because shutdown waited for that write. These tests pin both: the drop
//! happens one timeout after the client took its last byte, and stopping the server
//! abandons a stalled reply after `shutdown_reply_timeout` however long
//! `reply_write_timeout` is.

mod common;
use common::*;
use dedupvol_nbd::proto::*;
use dedupvol_nbd::ConnectionLimits;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Reads whose replies (simple replies carry the data) far exceed the socket buffers.
const READS: u64 = 32;
const READ_BYTES: u32 = 1 << 20;

/// GO without structured replies, then `READS` reads of `READ_BYTES`, never reading a reply.
fn stall(s: &mut UnixStream) {
    go(s, "vol");
    for i in 0..READS {
        send_request(s, CMD_READ, 0, i, 0, READ_BYTES, &[]);
    }
}

/// Waits until the server hangs up on `s` (POLLRDHUP: seen even with unread replies queued);
/// returns how long that took, or None if it did not happen within `limit`.
fn wait_hangup(s: &UnixStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    loop {
        let left = limit.checked_sub(start.elapsed())?;
        let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
        if r > 0 && pfd.revents != 0 {
            return Some(start.elapsed());
        }
    }
}

#[test]
fn a_client_that_stops_reading_is_dropped_after_one_reply_write_timeout() {
    let timeout = Duration::from_secs(2);
    let srv = TestServer::start_limits(
        64 << 20,
        false,
        4,
        ConnectionLimits { reply_write_timeout: timeout, ..test_limits() },
    );
    let mut s = connect_raw(&srv.socket);
    stall(&mut s);
    let took =
        wait_hangup(&s, Duration::from_secs(30)).expect("the server never dropped a client that stopped reading");
    // The replies fill the socket buffers within milliseconds of the requests; from then on
    // the client takes nothing. Two timeouts (the bug) would be >= 4 s.
    assert!(took >= timeout - Duration::from_millis(300), "dropped after {took:?}, before the {timeout:?} timeout");
    assert!(took < timeout + Duration::from_millis(1500), "dropped after {took:?}; the timeout is {timeout:?}");
    drop(s);
    srv.shutdown();
}

#[test]
fn a_client_still_reading_slowly_is_not_dropped() {
    // Progress resets the clock: a client taking a reply in small sips over more than one
    // timeout keeps its connection.
    let timeout = Duration::from_secs(1);
    let srv = TestServer::start_limits(
        64 << 20,
        false,
        4,
        ConnectionLimits { reply_write_timeout: timeout, ..test_limits() },
    );
    let mut s = connect_raw(&srv.socket);
    go(&mut s, "vol");
    send_request(&mut s, CMD_READ, 0, 7, 0, 4 << 20, &[]);
    let start = Instant::now();
    let (err, cookie) = read_reply(&mut s);
    assert_eq!((err, cookie), (0, 7));
    let mut left = 4usize << 20;
    let mut buf = vec![0u8; 256 << 10];
    while left > 0 {
        let n = buf.len().min(left);
        std::io::Read::read_exact(&mut s, &mut buf[..n]).expect("reply data");
        left -= n;
        // 16 sips of 256 KiB, 150 ms apart: 2.4 s in all, well past the 1 s timeout.
        std::thread::sleep(Duration::from_millis(150));
    }
    assert!(start.elapsed() > timeout * 2, "the test did not outlast the timeout");
    send_request(&mut s, CMD_FLUSH, 0, 8, 0, 0, &[]);
    assert_eq!(read_reply(&mut s), (0, 8), "connection lost while the client was reading");
    srv.shutdown();
}

#[test]
fn stopping_the_server_does_not_wait_for_a_client_that_stopped_reading() {
    // The default 60 s reply timeout: only the shutdown limit may end the stalled write.
    let limits = ConnectionLimits { shutdown_reply_timeout: Duration::from_secs(1), ..test_limits() };
    assert_eq!(limits.reply_write_timeout, Duration::from_secs(60));
    let srv = TestServer::start_limits(64 << 20, false, 4, limits);
    let mut s = connect_raw(&srv.socket);
    stall(&mut s);
    // Let the server get stuck in the reply write before stopping it.
    assert!(wait_hangup(&s, Duration::from_millis(500)).is_none(), "dropped before the stop");
    let start = Instant::now();
    let summary = srv.shutdown();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(8), "stopping took {took:?} with a stalled client connected");
    assert_eq!(summary.connections_served, 1);
    drop(s);
}
