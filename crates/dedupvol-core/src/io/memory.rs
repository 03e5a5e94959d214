//! A RAM-backed device for tests and benchmarks.

use super::Storage;
use parking_lot::RwLock;
use std::io;

/// A RAM-backed device. Every write is immediately "durable" (no crash model: the
/// simulator crate provides one).
pub struct MemStorage {
    chunks: Vec<RwLock<Vec<u8>>>,
    len: u64,
}

const MEM_CHUNK_BYTES: u64 = 1 << 20;

impl MemStorage {
    /// A zero-filled device of `len` bytes (memory is committed lazily per 1 MiB chunk).
    pub fn new(len: u64) -> Self {
        let n = len.div_ceil(MEM_CHUNK_BYTES);
        MemStorage { chunks: (0..n).map(|_| RwLock::new(Vec::new())).collect(), len }
    }

    fn for_each_chunk(
        &self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(&RwLock<Vec<u8>>, usize, usize, usize),
    ) -> io::Result<()> {
        if offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "access beyond end of memory device"));
        }
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let chunk = (pos / MEM_CHUNK_BYTES) as usize;
            let within = (pos % MEM_CHUNK_BYTES) as usize;
            let n = (len - done).min(MEM_CHUNK_BYTES as usize - within);
            let lock = self.chunks.get(chunk).ok_or_else(|| io::Error::other("chunk index"))?;
            f(lock, within, done, n);
            done += n;
        }
        Ok(())
    }
}

#[expect(clippy::indexing_slicing, reason = "for_each_chunk bounds every range to the device and the 1 MiB chunk")]
impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len();
        self.for_each_chunk(offset, len, |lock, within, done, n| {
            let c = lock.read();
            let dst = &mut buf[done..done + n];
            if c.is_empty() {
                dst.fill(0);
            } else {
                dst.copy_from_slice(&c[within..within + n]);
            }
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.for_each_chunk(offset, buf.len(), |lock, within, done, n| {
            let mut c = lock.write();
            if c.is_empty() {
                c.resize(MEM_CHUNK_BYTES as usize, 0);
            }
            c[within..within + n].copy_from_slice(&buf[done..done + n]);
        })
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn name(&self) -> String {
        "memory".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_storage_round_trip_across_chunks() {
        let m = MemStorage::new(3 * MEM_CHUNK_BYTES);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let off = MEM_CHUNK_BYTES - 5000;
        m.write_at(&data, off).expect("write");
        let mut back = vec![0u8; data.len()];
        m.read_at(&mut back, off).expect("read");
        assert_eq!(back, data);
        assert!(m.read_at(&mut back, 3 * MEM_CHUNK_BYTES - 10).is_err());
    }
}
