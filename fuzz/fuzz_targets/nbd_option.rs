//! Handshake decoders (client flags, option header, INFO/GO data, export names, metadata
//! context queries): no panic on any bytes, and parsed values obey the protocol bounds.
#![no_main]
use dedupvol_nbd::proto::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_client_flags(data.get(..4).unwrap_or(data));
    if let Ok(h) = parse_option_header(data.get(..16).unwrap_or(data)) {
        assert!(h.len <= OPTION_DATA_BYTES_MAX);
    }
    if let Ok(r) = parse_info_request(data) {
        assert!(r.name.len() <= NAME_BYTES_MAX && r.requests.len() <= INFO_REQUESTS_MAX);
    }
    let _ = parse_name(data);
    if let Ok(r) = dedupvol_nbd::block_status::parse_meta_context_request(data) {
        assert!(r.export.len() <= NAME_BYTES_MAX);
        assert!(r.queries.len() <= dedupvol_nbd::block_status::META_QUERIES_MAX);
    }
});
