//! Small byte-level helpers shared by the on-disk structures: checksums over blocks with an
//! embedded checksum field, and bounds-checked little-endian field access.
//!
//! Invariants:
//! - A block checksum is crc32c over the whole block with its 4-byte checksum field read as
//!   zeros, so a block can be verified in place without copying.
//! - Field accessors never panic: an out-of-range access reads as 0 / is ignored, and callers
//!   only use them at offsets fixed by compile-time-asserted layouts.

/// crc32c of `buf` with the 4 bytes at `field` treated as zero. A buffer too short to hold
/// the field is summed as if padded to it; `crc_ok` refuses such a buffer outright.
pub fn block_crc(buf: &[u8], field: usize) -> u32 {
    let (head, rest) = buf.split_at(field.min(buf.len()));
    let tail = rest.get(4..).unwrap_or_default();
    let c = crc32c::crc32c(head);
    let c = crc32c::crc32c_append(c, &[0u8; 4]);
    crc32c::crc32c_append(c, tail)
}

/// Stores the block checksum into its field.
pub fn seal_crc(buf: &mut [u8], field: usize) {
    let c = block_crc(buf, field);
    put_u32(buf, field, c);
}

/// True when the stored checksum matches (never for a buffer too short to hold it).
pub fn crc_ok(buf: &[u8], field: usize) -> bool {
    buf.len() >= field + 4 && get_u32(buf, field) == block_crc(buf, field)
}

/// Little-endian u16 at `off` (0 when out of range).
pub fn get_u16(buf: &[u8], off: usize) -> u16 {
    buf.get(off..off + 2).and_then(|s| s.try_into().ok()).map_or(0, u16::from_le_bytes)
}
/// Little-endian u32 at `off` (0 when out of range).
pub fn get_u32(buf: &[u8], off: usize) -> u32 {
    buf.get(off..off + 4).and_then(|s| s.try_into().ok()).map_or(0, u32::from_le_bytes)
}
/// Little-endian u64 at `off` (0 when out of range).
pub fn get_u64(buf: &[u8], off: usize) -> u64 {
    buf.get(off..off + 8).and_then(|s| s.try_into().ok()).map_or(0, u64::from_le_bytes)
}
/// Stores a little-endian u16 at `off` (ignored when out of range).
pub fn put_u16(buf: &mut [u8], off: usize, v: u16) {
    if let Some(s) = buf.get_mut(off..off + 2) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}
/// Stores a little-endian u32 at `off` (ignored when out of range).
pub fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    if let Some(s) = buf.get_mut(off..off + 4) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}
/// Stores a little-endian u64 at `off` (ignored when out of range).
pub fn put_u64(buf: &mut [u8], off: usize, v: u64) {
    if let Some(s) = buf.get_mut(off..off + 8) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

/// True when every byte is zero (word at a time).
pub fn is_zero(buf: &[u8]) -> bool {
    let (pre, words, post) = unsafe {
        // SAFETY: any byte pattern is a valid u64; align_to only reinterprets the aligned middle.
        buf.align_to::<u64>()
    };
    pre.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

/// Incompressible pseudo-random bytes (xorshift64) for unit tests.
#[cfg(test)]
pub(crate) fn test_random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_detects_any_flipped_bit_and_ignores_its_own_field() {
        let mut b = vec![7u8; 4096];
        seal_crc(&mut b, 8);
        assert!(crc_ok(&b, 8));
        b[100] ^= 1;
        assert!(!crc_ok(&b, 8));
        b[100] ^= 1;
        b[9] ^= 0x80;
        assert!(!crc_ok(&b, 8));
    }

    #[test]
    fn a_buffer_too_short_for_its_checksum_field_never_passes() {
        for len in 0..12 {
            // The stored checksum reads as 0; whatever the bytes sum to, the buffer fails.
            for fill in 0..=255u8 {
                assert!(!crc_ok(&vec![fill; len], 8), "{len} bytes of {fill}");
            }
        }
    }

    #[test]
    fn zero_detection() {
        let mut b = vec![0u8; 4096];
        assert!(is_zero(&b));
        b[4095] = 1;
        assert!(!is_zero(&b));
        assert!(is_zero(&b[1..4095]));
    }
}
