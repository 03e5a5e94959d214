//! Small, fast, seedable randomness for data generation.
//!
//! Generated data must come out at several GB/s per core so the generator never limits an
//! engine benchmark; a cryptographic RNG (ChaCha) would. These are statistical generators
//! only — the data is meant to be incompressible and unpredictable to a compressor, not to an
//! attacker.
//!
//! Invariants:
//! - Pure functions of their inputs: the same seed gives the same stream on every machine
//!   (little-endian byte order is fixed).

/// SplitMix64-style finaliser of `seed` and `x`: a well-mixed 64-bit hash.
pub fn mix64(seed: u64, x: u64) -> u64 {
    let mut z = seed ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Maps a hash to `[0, 1)` with 53 bits of precision.
pub fn unit_f64(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// wyrand: one multiply per 8 bytes.
#[derive(Debug, Clone)]
pub struct WyRand {
    state: u64,
}

impl WyRand {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        WyRand { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0xA076_1D64_78BD_642F);
        let t = u128::from(self.state) * u128::from(self.state ^ 0xE703_7ED1_A0B4_28DB);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// A uniform value in `0..n` (`n > 0`; the modulo bias is below 2^-32 for `n < 2^32`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A uniform value in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        for (b, v) in rest.iter_mut().zip(last) {
            *b = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let mut a = WyRand::new(1);
        let mut b = WyRand::new(1);
        let mut c = WyRand::new(2);
        let xa: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        let xc: Vec<u64> = (0..16).map(|_| c.next_u64()).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
        assert_ne!(mix64(0, 1), mix64(0, 2));
    }

    #[test]
    fn random_bytes_do_not_compress() {
        let mut r = WyRand::new(9);
        let mut buf = vec![0u8; 1 << 16];
        r.fill(&mut buf);
        let c = lz4_flex::block::compress(&buf);
        assert!(c.len() >= buf.len(), "LZ4 compressed random bytes to {}", c.len());
    }
}
