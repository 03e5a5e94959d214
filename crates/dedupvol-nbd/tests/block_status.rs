//! Metadata context negotiation and `NBD_CMD_BLOCK_STATUS` over the wire, against a RAM
//! disk whose all-zero blocks are reported as holes: what a client sees before and after
//! selecting `base:allocation`, and that bad requests get an NBD error, not a hang-up.

mod common;
use common::*;
use dedupvol_nbd::block_status::*;
use dedupvol_nbd::proto::*;
use std::os::unix::net::UnixStream;

fn meta_data(export: &str, queries: &[&str]) -> Vec<u8> {
    encode_meta_request(export, queries)
}

/// Replies to one option up to and including the final one: (reply type, data).
fn replies(s: &mut UnixStream, option: u32) -> Vec<(u32, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let (opt, rep, data) = read_option_reply(s);
        assert_eq!(opt, option);
        let last = rep != REP_META_CONTEXT && rep != REP_INFO;
        out.push((rep, data));
        if last {
            return out;
        }
    }
}

/// Reads one structured chunk: (flags, type, cookie, payload).
fn read_chunk(s: &mut UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let h = read_n(s, STRUCTURED_REPLY_HEADER_BYTES);
    assert_eq!(u32_at(&h, 0), STRUCTURED_REPLY_MAGIC);
    let len = u32_at(&h, 16) as usize;
    (u16_at(&h, 4), u16_at(&h, 6), u64_at(&h, 8), read_n(s, len))
}

/// Structured replies, `base:allocation` selected for `vol`, then GO.
fn negotiated(socket: &std::path::PathBuf) -> UnixStream {
    let mut s = connect_raw(socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(replies(&mut s, OPT_STRUCTURED_REPLY)[0].0, REP_ACK);
    send_option(&mut s, OPT_SET_META_CONTEXT, &meta_data("vol", &["x-unknown:thing", BASE_ALLOCATION]));
    let r = replies(&mut s, OPT_SET_META_CONTEXT);
    assert_eq!(r.len(), 2, "one context, then ACK");
    assert_eq!(r[0].0, REP_META_CONTEXT);
    assert_eq!(u32_at(&r[0].1, 0), BASE_ALLOCATION_ID);
    assert_eq!(&r[0].1[4..], BASE_ALLOCATION.as_bytes());
    assert_eq!(r[1].0, REP_ACK);
    send_option(&mut s, OPT_GO, &info_data("vol", &[]));
    assert_eq!(replies(&mut s, OPT_GO).last().map(|r| r.0), Some(REP_ACK));
    s
}

/// (length, flags) descriptors of a block status chunk for our context.
fn descriptors_of(payload: &[u8]) -> Vec<(u32, u32)> {
    assert_eq!(u32_at(payload, 0), BASE_ALLOCATION_ID);
    payload[4..].chunks_exact(8).map(|c| (u32_at(c, 0), u32_at(c, 4))).collect()
}

const HOLE: u32 = STATE_HOLE | STATE_ZERO;

#[test]
fn block_status_reports_holes_and_data_in_merged_runs() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = negotiated(&srv.socket);
    // Data in blocks 1 and 2 (8 KiB at 4096), and one byte in block 5.
    send_request(&mut s, CMD_WRITE, 0, 1, 4096, 8192, &vec![0xab; 8192]);
    assert_eq!(read_chunk_or_simple(&mut s), (0, 1));
    send_request(&mut s, CMD_WRITE, 0, 2, 5 * 4096 + 7, 1, &[1]);
    assert_eq!(read_chunk_or_simple(&mut s), (0, 2));

    send_request(&mut s, CMD_BLOCK_STATUS, 0, 3, 0, 8 * 4096, &[]);
    let (flags, kind, cookie, payload) = read_chunk(&mut s);
    assert_eq!((flags & REPLY_FLAG_DONE, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 3));
    assert_eq!(descriptors_of(&payload), vec![(4096, HOLE), (8192, 0), (8192, HOLE), (4096, 0), (8192, HOLE)]);

    // REQ_ONE: exactly one descriptor, never longer than the request.
    send_request(&mut s, CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4, 4096, 100, &[]);
    let (_, _, _, payload) = read_chunk(&mut s);
    assert_eq!(descriptors_of(&payload), vec![(100, 0)]);

    // Whole export, unaligned start: covers the rest, ends at the end of the export.
    send_request(&mut s, CMD_BLOCK_STATUS, 0, 5, 10, (1 << 20) - 10, &[]);
    let (_, _, _, payload) = read_chunk(&mut s);
    let d = descriptors_of(&payload);
    assert_eq!(d.first(), Some(&(4086, HOLE)));
    assert_eq!(d.iter().map(|x| u64::from(x.0)).sum::<u64>(), (1 << 20) - 10);

    // Past the end, zero length, and unknown flags: errors, and the connection goes on.
    for (cookie, flags, offset, len) in [(6, 0, 1 << 20, 1), (7, 0, 0, 0), (8, CMD_FLAG_FUA, 0, 4096)] {
        send_request(&mut s, CMD_BLOCK_STATUS, flags, cookie, offset, len, &[]);
        assert_eq!(read_chunk_or_simple(&mut s), (NBD_EINVAL, cookie));
    }
    send_request(&mut s, CMD_BLOCK_STATUS, 0, 9, 0, 4096, &[]);
    assert_eq!(read_chunk(&mut s).2, 9);
    srv.shutdown();
}

/// Reads a simple reply, or a structured error/none chunk: (NBD error, cookie).
fn read_chunk_or_simple(s: &mut UnixStream) -> (u32, u64) {
    let h = read_n(s, 4);
    if u32_at(&h, 0) == SIMPLE_REPLY_MAGIC {
        let rest = read_n(s, SIMPLE_REPLY_BYTES - 4);
        return (u32_at(&rest, 0), u64_at(&rest, 4));
    }
    assert_eq!(u32_at(&h, 0), STRUCTURED_REPLY_MAGIC);
    let rest = read_n(s, STRUCTURED_REPLY_HEADER_BYTES - 4);
    let payload = read_n(s, u32_at(&rest, 12) as usize);
    let error = if u16_at(&rest, 2) & (1 << 15) != 0 { u32_at(&payload, 0) } else { 0 };
    (error, u64_at(&rest, 4))
}

#[test]
fn block_status_without_a_selected_context_is_einval_not_a_hang_up() {
    let srv = TestServer::start(1 << 20, false, 4);
    // Structured replies but no SET_META_CONTEXT.
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(replies(&mut s, OPT_STRUCTURED_REPLY)[0].0, REP_ACK);
    send_option(&mut s, OPT_GO, &info_data("vol", &[]));
    assert_eq!(replies(&mut s, OPT_GO).last().map(|r| r.0), Some(REP_ACK));
    send_request(&mut s, CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    assert_eq!(read_chunk_or_simple(&mut s), (NBD_EINVAL, 1));
    send_request(&mut s, CMD_READ, 0, 2, 0, 16, &[]);
    assert_eq!(read_chunk(&mut s).2, 2, "the connection still serves reads");

    // No structured replies at all: SET is refused, and block status stays refused.
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(&mut s, OPT_SET_META_CONTEXT, &meta_data("vol", &[BASE_ALLOCATION]));
    assert_eq!(replies(&mut s, OPT_SET_META_CONTEXT)[0].0, REP_ERR_INVALID);
    send_option(&mut s, OPT_GO, &info_data("", &[]));
    assert_eq!(replies(&mut s, OPT_GO).last().map(|r| r.0), Some(REP_ACK));
    send_request(&mut s, CMD_BLOCK_STATUS, 0, 3, 0, 4096, &[]);
    assert_eq!(read_reply(&mut s), (NBD_EINVAL, 3));
    srv.shutdown();
}

#[test]
fn list_and_set_answer_queries_limits_and_unknown_exports() {
    let srv = TestServer::start(1 << 20, false, 4);
    let mut s = connect_raw(&srv.socket);
    greet(&mut s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    replies(&mut s, OPT_STRUCTURED_REPLY);
    let ask = |s: &mut UnixStream, option: u32, export: &str, queries: &[&str]| {
        send_option(s, option, &meta_data(export, queries));
        replies(s, option).into_iter().map(|(rep, d)| (rep, d.get(4..).map(|n| n.to_vec()))).collect::<Vec<_>>()
    };
    let ctx = (REP_META_CONTEXT, Some(BASE_ALLOCATION.as_bytes().to_vec()));
    let ack = REP_ACK;
    let kinds = |r: &[(u32, Option<Vec<u8>>)]| r.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ask(&mut s, OPT_LIST_META_CONTEXT, "", &[])[0], ctx, "no query lists everything");
    assert_eq!(ask(&mut s, OPT_LIST_META_CONTEXT, "vol", &["base:"])[0], ctx, "base: is a wildcard");
    assert_eq!(kinds(&ask(&mut s, OPT_LIST_META_CONTEXT, "vol", &["qemu:dirty-bitmap:x"])), vec![ack]);
    assert_eq!(kinds(&ask(&mut s, OPT_LIST_META_CONTEXT, "other", &[])), vec![REP_ERR_UNKNOWN]);
    assert_eq!(kinds(&ask(&mut s, OPT_LIST_META_CONTEXT, "vol", &["nocolon"])), vec![REP_ERR_INVALID]);
    let many = vec!["base:allocation"; META_QUERIES_MAX + 1];
    assert_eq!(kinds(&ask(&mut s, OPT_SET_META_CONTEXT, "vol", &many)), vec![REP_ERR_TOO_BIG]);
    assert_eq!(kinds(&ask(&mut s, OPT_SET_META_CONTEXT, "vol", &["base:"])), vec![ack], "wildcard selects nothing");
    assert_eq!(kinds(&ask(&mut s, OPT_SET_META_CONTEXT, "vol", &[BASE_ALLOCATION])), vec![REP_META_CONTEXT, ack]);
    // A later failed SET clears the selection: block status is then refused.
    assert_eq!(kinds(&ask(&mut s, OPT_SET_META_CONTEXT, "nope", &[BASE_ALLOCATION])), vec![REP_ERR_UNKNOWN]);
    send_option(&mut s, OPT_GO, &info_data("vol", &[]));
    assert_eq!(replies(&mut s, OPT_GO).last().map(|r| r.0), Some(REP_ACK));
    send_request(&mut s, CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    assert_eq!(read_chunk_or_simple(&mut s), (NBD_EINVAL, 1));
    srv.shutdown();
}
