//! Metadata contexts and `NBD_CMD_BLOCK_STATUS`: the wire format and the policy of the one
//! context this server offers, `base:allocation` (which ranges are holes that read as
//! zeros, so clients such as `qemu-img convert`, `nbdcopy` and `nbdinfo --map` skip them).
//!
//! Negotiation (`NBD_OPT_LIST_META_CONTEXT`, `NBD_OPT_SET_META_CONTEXT`):
//!
//! | option | structured replies | export    | queries                    | answer                          |
//! |--------|--------------------|-----------|----------------------------|---------------------------------|
//! | any    | any                | any       | malformed / no namespace   | `ERR_INVALID`                   |
//! | any    | any                | any       | > `META_QUERIES_MAX`       | `ERR_TOO_BIG`                   |
//! | any    | any                | unknown   | valid                      | `ERR_UNKNOWN`                   |
//! | LIST   | any                | ours      | none                       | `base:allocation`, ACK          |
//! | LIST   | any                | ours      | `base:` or `base:allocation` among them | `base:allocation`, ACK |
//! | LIST   | any                | ours      | only others                | ACK                             |
//! | SET    | not negotiated     | any       | any                        | `ERR_INVALID`, selection cleared |
//! | SET    | negotiated         | ours      | `base:allocation` among them | `base:allocation` with its id, ACK; selected |
//! | SET    | negotiated         | ours      | none, `base:`, or others   | ACK; nothing selected           |
//!
//! Every SET replaces the selection, whether it succeeds or fails (as the spec asks).
//!
//! Invariants:
//! - Parsers never panic and never allocate more than their input's length (plus a bounded
//!   constant): queries <= [`META_QUERIES_MAX`], each a valid protocol string.
//! - A block status reply holds at most [`BLOCK_STATUS_EXTENTS_MAX`] descriptors, each of
//!   non-zero length; they cover a non-empty prefix of the request and never go past its
//!   end; with `NBD_CMD_FLAG_REQ_ONE` there is exactly one.
//! - A hole is reported (`NBD_STATE_HOLE | NBD_STATE_ZERO`) only where the backend says
//!   the bytes read as zeros; anything else is reported as data (flags 0), which the spec
//!   allows for any block.

use crate::backend::{Backend, BackendError};
use crate::proto::{ParseError, NAME_BYTES_MAX, STRUCTURED_REPLY_HEADER_BYTES};
use dedupvol_core::{Extent, ExtentKind};

/// Option: list the metadata contexts of an export.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select the metadata contexts for the transmission phase.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// Option reply: one metadata context (id, name).
pub const REP_META_CONTEXT: u32 = 4;
/// Command: block status query.
pub const CMD_BLOCK_STATUS: u16 = 7;
/// Command flag: one extent per context, no longer than the request.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Structured reply chunk: a context id and a list of (length, flags) descriptors.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// `base:allocation` flag: the range is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: the range reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// The context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in SET replies and block status chunks (opaque to clients; any value would do).
pub const BASE_ALLOCATION_ID: u32 = 1;
/// Queries read from one LIST/SET at most; more are answered with `NBD_REP_ERR_TOO_BIG`
/// (one context exists, so no honest client needs many).
pub const META_QUERIES_MAX: usize = 64;
/// Descriptors in one block status reply at most: 512 KiB of reply (the spec suggests no
/// more than 2^20). A client asks again from where a shortened reply stops.
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 64 << 10;

/// The data of a LIST or SET option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    /// The export the contexts are for.
    pub export: String,
    /// The queries, each `namespace:leaf` (leaf possibly empty).
    pub queries: Vec<String>,
}

/// Why a LIST/SET was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaContextError {
    /// Malformed data or query (`NBD_REP_ERR_INVALID`).
    #[error("{0}")]
    Invalid(#[from] ParseError),
    /// More queries than [`META_QUERIES_MAX`] (`NBD_REP_ERR_TOO_BIG`).
    #[error("{count} metadata context queries exceed the limit of {META_QUERIES_MAX}")]
    TooBig {
        /// Queries the client announced.
        count: u32,
    },
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes(s.try_into().ok()?))
}

/// Reads a length-prefixed string at `*at`, advancing it.
fn take_string(b: &[u8], at: &mut usize, what: &str) -> Result<String, ParseError> {
    let invalid = |m: String| ParseError::Invalid(m);
    let len = be_u32(b, *at).ok_or_else(|| invalid(format!("{what}: length missing")))?;
    let len = usize::try_from(len).map_err(|_| invalid(format!("{what}: length")))?;
    if len > NAME_BYTES_MAX {
        return Err(invalid(format!("{what} of {len} bytes exceeds {NAME_BYTES_MAX}")));
    }
    let start = *at + 4;
    let bytes = b.get(start..start + len).ok_or_else(|| invalid(format!("{what} runs past the option data")))?;
    let s = std::str::from_utf8(bytes).map_err(|e| invalid(format!("{what} is not UTF-8: {e}")))?;
    if s.contains('\0') {
        return Err(invalid(format!("{what} contains NUL")));
    }
    *at = start + len;
    Ok(s.to_owned())
}

/// Parses LIST/SET option data: export name, query count, queries.
pub fn parse_meta_context_request(b: &[u8]) -> Result<MetaContextRequest, MetaContextError> {
    let mut at = 0;
    let export = take_string(b, &mut at, "export name")?;
    let count = be_u32(b, at).ok_or_else(|| ParseError::Invalid("query count missing".into()))?;
    at += 4;
    if count as usize > META_QUERIES_MAX {
        return Err(MetaContextError::TooBig { count });
    }
    let mut queries = Vec::with_capacity(count as usize);
    for i in 0..count {
        let q = take_string(b, &mut at, &format!("query {i}"))?;
        match q.split_once(':') {
            Some((ns, _)) if !ns.is_empty() => queries.push(q),
            _ => return Err(ParseError::Invalid(format!("query {q:?} lacks a namespace and a colon")).into()),
        }
    }
    if at != b.len() {
        return Err(ParseError::Invalid(format!("{} bytes after the last query", b.len() - at)).into());
    }
    Ok(MetaContextRequest { export, queries })
}

/// Contexts a LIST answers: all of ours for no query; otherwise those a query names, with
/// `base:` as the wildcard of its namespace. Unknown namespaces and leaves are ignored.
pub fn list_contexts(queries: &[String]) -> Vec<&'static str> {
    let wanted = queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION);
    if wanted {
        vec![BASE_ALLOCATION]
    } else {
        Vec::new()
    }
}

/// Whether a SET selects `base:allocation` (only by its full name: `base:` selects nothing).
pub fn set_selects_allocation(queries: &[String]) -> bool {
    queries.iter().any(|q| q == BASE_ALLOCATION)
}

/// The answer to one LIST or SET, decided by the table in the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiation {
    /// Option replies to send in order: (reply type, data); the last is final.
    pub replies: Vec<(u32, Vec<u8>)>,
    /// For SET, the new selection (`base:allocation` or nothing); None for LIST.
    pub allocation: Option<bool>,
}

/// Answers `NBD_OPT_LIST_META_CONTEXT` or `NBD_OPT_SET_META_CONTEXT`. `structured`: the
/// client negotiated structured replies; `known`: whether an export name is served.
pub fn negotiate(option: u32, data: &[u8], structured: bool, known: impl Fn(&str) -> bool) -> Negotiation {
    use crate::proto::{REP_ACK, REP_ERR_INVALID, REP_ERR_TOO_BIG, REP_ERR_UNKNOWN};
    let set = option == OPT_SET_META_CONTEXT;
    let refuse = |reply: u32, msg: String| Negotiation {
        replies: vec![(reply, msg.into_bytes())],
        allocation: set.then_some(false),
    };
    if set && !structured {
        return refuse(REP_ERR_INVALID, "SET_META_CONTEXT needs structured replies negotiated first".into());
    }
    let req = match parse_meta_context_request(data) {
        Ok(r) => r,
        Err(e @ MetaContextError::Invalid(_)) => return refuse(REP_ERR_INVALID, e.to_string()),
        Err(e @ MetaContextError::TooBig { .. }) => return refuse(REP_ERR_TOO_BIG, e.to_string()),
    };
    if !known(&req.export) {
        return refuse(REP_ERR_UNKNOWN, format!("no export named {:?}", req.export));
    }
    let mut replies = Vec::new();
    let allocation = if set {
        let selected = set_selects_allocation(&req.queries);
        if selected {
            replies.push((REP_META_CONTEXT, encode_meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION)));
        }
        Some(selected)
    } else {
        // LIST replies carry id 0: the spec reserves it there.
        for name in list_contexts(&req.queries) {
            replies.push((REP_META_CONTEXT, encode_meta_context(0, name)));
        }
        None
    };
    replies.push((REP_ACK, Vec::new()));
    Negotiation { replies, allocation }
}

/// `NBD_REP_META_CONTEXT` payload: id, name.
pub fn encode_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d
}

/// The `base:allocation` descriptors for a request of `len` bytes: (length, flags) pairs,
/// clipped to the request, at most [`BLOCK_STATUS_EXTENTS_MAX`], one with `req_one`.
pub fn descriptors(extents: &[Extent], len: u32, req_one: bool) -> Vec<(u32, u32)> {
    let cap = if req_one { 1 } else { BLOCK_STATUS_EXTENTS_MAX };
    let mut out = Vec::with_capacity(extents.len().min(cap));
    let mut left = u64::from(len);
    for e in extents {
        if left == 0 || out.len() == cap {
            break;
        }
        let n = e.len.min(left);
        if n == 0 {
            continue;
        }
        let flags = match e.kind {
            ExtentKind::Hole => STATE_HOLE | STATE_ZERO,
            ExtentKind::Data => 0,
        };
        // n <= left <= len, a u32.
        out.push((n as u32, flags));
        left -= n;
    }
    out
}

/// A complete final `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for context `id`.
pub fn encode_block_status_chunk(cookie: u64, id: u32, descriptors: &[(u32, u32)]) -> Vec<u8> {
    let payload = 4 + 8 * descriptors.len();
    let mut out = Vec::with_capacity(STRUCTURED_REPLY_HEADER_BYTES + payload);
    // payload <= 4 + 8 * BLOCK_STATUS_EXTENTS_MAX, far below u32::MAX.
    out.extend_from_slice(&crate::proto::encode_chunk_header(
        crate::proto::REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        payload as u32,
    ));
    out.extend_from_slice(&id.to_be_bytes());
    for &(len, flags) in descriptors {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// Answers one block status request: the whole reply chunk, or the backend's error.
pub fn reply(
    backend: &dyn Backend,
    cookie: u64,
    offset: u64,
    len: u32,
    req_one: bool,
) -> Result<Vec<u8>, BackendError> {
    let extents_max = if req_one { 1 } else { BLOCK_STATUS_EXTENTS_MAX };
    let extents = backend.block_status(offset, u64::from(len), extents_max)?;
    let d = descriptors(&extents, len, req_one);
    if d.is_empty() {
        // The spec requires at least one descriptor; a backend that found nothing broke
        // its contract, and the client must not loop on an empty answer.
        return Err(BackendError::new(
            libc::EIO,
            format!("block status at {offset}+{len}: the backend reported no extent"),
        ));
    }
    Ok(encode_block_status_chunk(cookie, BASE_ALLOCATION_ID, &d))
}

/// The data of a LIST or SET_META_CONTEXT option asking `export` for `queries` (what a
/// client sends; the tests and fuzzers build their requests with it).
pub fn encode_meta_request(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(export.len() as u32).to_be_bytes());
    b.extend_from_slice(export.as_bytes());
    b.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        b.extend_from_slice(&(q.len() as u32).to_be_bytes());
        b.extend_from_slice(q.as_bytes());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(export: &str, queries: &[&str]) -> Vec<u8> {
        encode_meta_request(export, queries)
    }

    #[test]
    fn requests_parse_and_bad_ones_are_refused() {
        let r = parse_meta_context_request(&request("vol", &["base:allocation", "qemu:dirty-bitmap:x"])).expect("ok");
        assert_eq!(r.export, "vol");
        assert_eq!(r.queries.len(), 2);
        let bad = |b: &[u8]| matches!(parse_meta_context_request(b), Err(MetaContextError::Invalid(_)));
        assert!(bad(&request("vol", &["nocolon"])));
        assert!(bad(&request("vol", &[":leaf"])));
        let full = request("vol", &["base:allocation"]);
        assert!(bad(&full[..full.len() - 1]), "truncated query");
        assert!(bad(&[full.as_slice(), &[0]].concat()), "trailing byte");
        assert!(bad(&[]));
        let many: Vec<&str> = vec!["x-a:b"; META_QUERIES_MAX + 1];
        assert_eq!(
            parse_meta_context_request(&request("vol", &many)),
            Err(MetaContextError::TooBig { count: META_QUERIES_MAX as u32 + 1 })
        );
        // A huge announced count with no data is refused before anything is allocated.
        let mut huge = request("", &[]);
        huge[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(parse_meta_context_request(&huge), Err(MetaContextError::TooBig { .. })));
    }

    #[test]
    fn list_and_set_follow_the_base_namespace_rules() {
        let q = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(list_contexts(&[]), vec![BASE_ALLOCATION]);
        assert_eq!(list_contexts(&q(&["base:"])), vec![BASE_ALLOCATION]);
        assert_eq!(list_contexts(&q(&["x-other:", "base:allocation"])), vec![BASE_ALLOCATION]);
        assert!(list_contexts(&q(&["base:unknown", "qemu:dirty-bitmap:a"])).is_empty());
        assert!(set_selects_allocation(&q(&["qemu:x", "base:allocation"])));
        assert!(!set_selects_allocation(&q(&["base:"])), "the wildcard selects nothing in SET");
        assert!(!set_selects_allocation(&[]));
    }

    #[test]
    fn negotiation_follows_the_table() {
        use crate::proto::{REP_ACK, REP_ERR_INVALID, REP_ERR_TOO_BIG, REP_ERR_UNKNOWN};
        let known = |n: &str| n.is_empty() || n == "vol";
        let kinds = |n: &Negotiation| n.replies.iter().map(|r| r.0).collect::<Vec<_>>();
        let set = negotiate(OPT_SET_META_CONTEXT, &request("vol", &["base:allocation"]), true, known);
        assert_eq!(kinds(&set), vec![REP_META_CONTEXT, REP_ACK]);
        assert_eq!(set.allocation, Some(true));
        assert_eq!(&set.replies[0].1[..4], &BASE_ALLOCATION_ID.to_be_bytes());
        let unstructured = negotiate(OPT_SET_META_CONTEXT, &request("vol", &["base:allocation"]), false, known);
        assert_eq!((kinds(&unstructured), unstructured.allocation), (vec![REP_ERR_INVALID], Some(false)));
        let unknown = negotiate(OPT_SET_META_CONTEXT, &request("nope", &["base:allocation"]), true, known);
        assert_eq!((kinds(&unknown), unknown.allocation), (vec![REP_ERR_UNKNOWN], Some(false)));
        let wildcard = negotiate(OPT_SET_META_CONTEXT, &request("", &["base:"]), true, known);
        assert_eq!((kinds(&wildcard), wildcard.allocation), (vec![REP_ACK], Some(false)));
        let list = negotiate(OPT_LIST_META_CONTEXT, &request("", &[]), false, known);
        assert_eq!((kinds(&list), list.allocation), (vec![REP_META_CONTEXT, REP_ACK], None));
        assert_eq!(&list.replies[0].1[..4], &[0, 0, 0, 0]);
        let other = negotiate(OPT_LIST_META_CONTEXT, &request("vol", &["qemu:dirty-bitmap:a"]), true, known);
        assert_eq!(kinds(&other), vec![REP_ACK]);
        let many: Vec<&str> = vec!["base:"; META_QUERIES_MAX + 1];
        assert_eq!(
            kinds(&negotiate(OPT_LIST_META_CONTEXT, &request("vol", &many), true, known)),
            vec![REP_ERR_TOO_BIG]
        );
    }

    #[test]
    fn descriptors_are_clipped_bounded_and_flagged() {
        let e = [
            Extent { len: 8192, kind: ExtentKind::Hole },
            Extent { len: 4096, kind: ExtentKind::Data },
            Extent { len: 1 << 40, kind: ExtentKind::Hole },
        ];
        assert_eq!(
            descriptors(&e, 16384, false),
            vec![(8192, STATE_HOLE | STATE_ZERO), (4096, 0), (4096, STATE_HOLE | STATE_ZERO)]
        );
        assert_eq!(descriptors(&e, 100, true), vec![(100, STATE_HOLE | STATE_ZERO)]);
        assert_eq!(descriptors(&e, 16384, true).len(), 1);
        let many = vec![Extent { len: 1, kind: ExtentKind::Data }; BLOCK_STATUS_EXTENTS_MAX + 5];
        assert_eq!(descriptors(&many, u32::MAX, false).len(), BLOCK_STATUS_EXTENTS_MAX);
        let chunk = encode_block_status_chunk(9, BASE_ALLOCATION_ID, &[(4096, 3)]);
        assert_eq!(chunk.len(), STRUCTURED_REPLY_HEADER_BYTES + 12);
        assert_eq!(u16::from_be_bytes([chunk[6], chunk[7]]), REPLY_TYPE_BLOCK_STATUS);
        assert_eq!(u32::from_be_bytes([chunk[16], chunk[17], chunk[18], chunk[19]]), 12);
    }
}
