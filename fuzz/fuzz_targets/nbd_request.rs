//! Transmission request header decoder and classifier: no panic on any bytes; whatever
//! is executed lies inside the export and within the request size bound.
#![no_main]
use dedupvol_nbd::proto::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (limits, hdr) = data.split_at(data.len().min(9));
    let size = limits.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let read_only = limits.get(8).is_some_and(|b| b & 1 == 1);
    let block_status = limits.get(8).is_some_and(|b| b & 2 == 2);
    let export = ExportLimits { size, read_only, block_status };
    if let Ok(r) = parse_request(hdr) {
        assert_eq!(&encode_request(&r)[..], hdr);
        if let Disposition::Execute(c) = classify_request(&r, &export) {
            let (offset, len) = match c {
                Command::Read { offset, len } | Command::Write { offset, len, .. } => {
                    assert!(len <= REQUEST_BYTES_MAX);
                    (offset, len)
                }
                Command::Trim { offset, len, .. } | Command::WriteZeroes { offset, len, .. } => (offset, len),
                Command::Flush => (0, 0),
                Command::BlockStatus { offset, len, .. } => {
                    assert!(block_status && len > 0);
                    (offset, len)
                }
            };
            assert!(offset.checked_add(u64::from(len)).is_some_and(|end| end <= size));
        }
    }
});
