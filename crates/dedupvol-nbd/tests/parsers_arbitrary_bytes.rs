//! Every wire decoder fed arbitrary bytes: no panic, and whatever parses obeys the bounds
//! (the same properties the `fuzz/` targets check, but run by a plain `cargo test`).

use dedupvol_nbd::proto::*;
use proptest::prelude::*;

fn export() -> impl Strategy<Value = ExportLimits> {
    (any::<u64>(), any::<bool>(), any::<bool>()).prop_map(|(size, read_only, block_status)| ExportLimits {
        size,
        read_only,
        block_status,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn request_parser_and_classifier_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), e in export()) {
        if let Ok(r) = parse_request(&bytes) {
            prop_assert_eq!(bytes.len(), REQUEST_HEADER_BYTES);
            let encoded = encode_request(&r);
            prop_assert_eq!(encoded.as_slice(), bytes.as_slice());
            match classify_request(&r, &e) {
                Disposition::Execute(c) => {
                    let (off, len) = match c {
                        Command::Read { offset, len } | Command::Write { offset, len, .. } => {
                            prop_assert!(len <= REQUEST_BYTES_MAX);
                            (offset, len)
                        }
                        Command::Trim { offset, len, .. } | Command::WriteZeroes { offset, len, .. } => {
                            prop_assert!(!e.read_only);
                            (offset, len)
                        }
                        Command::Flush => (0, 0),
                        Command::BlockStatus { offset, len, .. } => {
                            prop_assert!(e.block_status && len > 0);
                            (offset, len)
                        }
                    };
                    prop_assert!(off.checked_add(u64::from(len)).is_some_and(|end| end <= e.size));
                    if matches!(c, Command::Write { .. }) { prop_assert!(!e.read_only); }
                }
                Disposition::Reject { skip, .. } => prop_assert!(skip <= REQUEST_BYTES_MAX),
                Disposition::Disconnect | Disposition::Close(_) => {}
            }
        }
    }

    #[test]
    fn structured_requests_classify_consistently(kind in 0u16..10, flags in any::<u16>(), offset in any::<u64>(), len in any::<u32>(), e in export()) {
        let r = Request { flags, kind, cookie: 1, offset, len };
        let d = classify_request(&r, &e);
        if e.read_only && matches!(kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
            prop_assert!(!matches!(d, Disposition::Execute(_)));
        }
    }

    #[test]
    fn option_parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..8200)) {
        let _ = parse_client_flags(bytes.get(..4).unwrap_or(&bytes));
        if let Ok(h) = parse_option_header(bytes.get(..16).unwrap_or(&bytes)) {
            prop_assert!(h.len <= OPTION_DATA_BYTES_MAX);
        }
        if let Ok(req) = parse_info_request(&bytes) {
            prop_assert!(req.name.len() <= NAME_BYTES_MAX);
            prop_assert!(req.requests.len() <= INFO_REQUESTS_MAX);
        }
        if let Ok(name) = parse_name(&bytes) {
            prop_assert!(!name.contains('\0'));
        }
        if let Ok(r) = dedupvol_nbd::block_status::parse_meta_context_request(&bytes) {
            prop_assert!(r.export.len() <= NAME_BYTES_MAX);
            prop_assert!(r.queries.len() <= dedupvol_nbd::block_status::META_QUERIES_MAX);
            prop_assert!(r.queries.iter().all(|q| q.contains(':') && !q.starts_with(':')));
        }
        for option in [dedupvol_nbd::block_status::OPT_LIST_META_CONTEXT, dedupvol_nbd::block_status::OPT_SET_META_CONTEXT] {
            let n = dedupvol_nbd::block_status::negotiate(option, &bytes, true, |_| true);
            prop_assert!(!n.replies.is_empty());
        }
    }
}
