//! Block contents named by a 64-bit id, so the checker stores ids instead of 4 KiB copies.
//!
//! Invariants:
//! - `fill(id)` is a pure function of `id`; id 0 is the zero block.
//! - Distinct non-zero ids give distinct contents (the id is stamped in the first 8 bytes,
//!   except for zero blocks), so equality of content is equality of id.
//! - The class (top two bits) decides how the content compresses and deduplicates.

/// Bytes of a logical block.
pub const BLOCK: usize = 4096;

/// The zero block.
pub const ZERO: u64 = 0;

/// What kind of data a content id holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// All zeros.
    Zero,
    /// One of a small pool of blocks that recur (dedup hits).
    Duplicate,
    /// Mostly repetitive (compresses to a fragment of variable size).
    Compressible,
    /// Random bytes (stored raw).
    Unique,
}

/// Duplicate contents drawn from a pool this size.
pub const DUPLICATE_POOL_SIZE: u64 = 24;

const CLASS_SHIFT: u32 = 62;

/// The id of the `n`-th content of `class`.
pub fn make(class: Class, n: u64) -> u64 {
    let n = n & ((1 << CLASS_SHIFT) - 1);
    match class {
        Class::Zero => ZERO,
        Class::Duplicate => (1 << CLASS_SHIFT) | (n % DUPLICATE_POOL_SIZE) | 1 << 32,
        Class::Compressible => (2 << CLASS_SHIFT) | n.max(1),
        Class::Unique => (3 << CLASS_SHIFT) | n.max(1),
    }
}

/// Marks a duplicate-pool id whose content compresses (a hot block of a packed block).
const COMPRESSIBLE_DUPLICATE_BIT: u64 = 1 << 33;

/// The `n`-th content of the duplicate pool, compressible: many references to one
/// fragment of a packed block, which reach the reference cap while the block is open.
pub fn make_compressible_duplicate(n: u64) -> u64 {
    make(Class::Duplicate, n) | COMPRESSIBLE_DUPLICATE_BIT
}

/// The class of `id`.
pub fn class(id: u64) -> Class {
    match id >> CLASS_SHIFT {
        _ if id == ZERO => Class::Zero,
        1 => Class::Duplicate,
        2 => Class::Compressible,
        _ => Class::Unique,
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Writes the content of `id` into `buf` (4 KiB).
pub fn fill(id: u64, buf: &mut [u8]) {
    assert_eq!(buf.len(), BLOCK);
    if id == ZERO {
        buf.fill(0);
        return;
    }
    let mut st = id;
    match class(id) {
        Class::Zero => buf.fill(0),
        Class::Duplicate if id & COMPRESSIBLE_DUPLICATE_BIT != 0 => {
            // Half random, half one repeated byte: about a 2 KiB fragment.
            for (i, c) in buf.chunks_exact_mut(8).enumerate() {
                let v = if i < BLOCK / 16 { splitmix(&mut st) } else { id.wrapping_mul(0x0101_0101_0101_0101) };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        Class::Unique | Class::Duplicate => {
            for c in buf.chunks_exact_mut(8) {
                c.copy_from_slice(&splitmix(&mut st).to_le_bytes());
            }
        }
        Class::Compressible => {
            // A random head of 64..2048 bytes, then a short repeating motif: the block
            // compresses to fragments of many different sizes, exercising the packer.
            let head = 64 + (splitmix(&mut st) % 1985) as usize;
            let motif: Vec<u8> = (0..16).map(|_| splitmix(&mut st) as u8).collect();
            for (i, b) in buf.iter_mut().enumerate() {
                *b = if i < head { splitmix(&mut st) as u8 } else { motif[i % motif.len()] };
            }
        }
    }
    buf[..8].copy_from_slice(&id.to_le_bytes());
}

/// The content of `id` as a new buffer.
pub fn block(id: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    fill(id, &mut b);
    b
}

/// The id whose content `buf` is, if it is one of `candidates`.
pub fn identify(buf: &[u8], candidates: &[u64]) -> Option<u64> {
    let mut tmp = vec![0u8; BLOCK];
    candidates.iter().copied().find(|&c| {
        fill(c, &mut tmp);
        tmp == buf
    })
}

/// Bytes of a sector.
pub const SECTOR: usize = 512;

/// Writes the content of a version (a content id per 512-byte sector) into `buf`.
pub fn fill_version(v: &[u64; 8], buf: &mut [u8]) {
    let mut tmp = vec![0u8; BLOCK];
    let mut last = None;
    for (s, &id) in v.iter().enumerate() {
        if last != Some(id) {
            fill(id, &mut tmp);
            last = Some(id);
        }
        buf[s * SECTOR..(s + 1) * SECTOR].copy_from_slice(&tmp[s * SECTOR..(s + 1) * SECTOR]);
    }
}

/// The version whose content `buf` is, if it is one of `candidates`.
pub fn identify_version(buf: &[u8], candidates: &[[u64; 8]]) -> Option<[u64; 8]> {
    let mut tmp = vec![0u8; BLOCK];
    candidates.iter().copied().find(|v| {
        fill_version(v, &mut tmp);
        tmp == buf
    })
}

/// A version for messages: `id` when all sectors agree, else the per-sector list.
pub fn version_name(v: &[u64; 8]) -> String {
    if v.iter().all(|&x| x == v[0]) {
        format!("{:#x}", v[0])
    } else {
        format!("{v:x?}")
    }
}

/// A short description of a block, for failure messages.
pub fn describe(buf: &[u8]) -> String {
    if buf.iter().all(|&b| b == 0) {
        return "zeros".to_string();
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&buf[..8]);
    format!("block stamped {:#x} (crc32c {:#010x})", u64::from_le_bytes(id), crc32c::crc32c(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_are_distinct_and_classed() {
        let ids = [make(Class::Duplicate, 3), make(Class::Compressible, 3), make(Class::Unique, 3), ZERO];
        let blocks: Vec<Vec<u8>> = ids.iter().map(|&i| block(i)).collect();
        for i in 0..ids.len() {
            for j in 0..ids.len() {
                assert_eq!(i == j, blocks[i] == blocks[j]);
            }
            assert_eq!(identify(&blocks[i], &ids), Some(ids[i]));
        }
        assert_eq!(class(ids[0]), Class::Duplicate);
        assert_eq!(class(ids[1]), Class::Compressible);
        assert_eq!(class(ids[2]), Class::Unique);
        assert_eq!(class(ZERO), Class::Zero);
        assert_eq!(make(Class::Duplicate, 3), make(Class::Duplicate, 3 + DUPLICATE_POOL_SIZE));
    }
}
