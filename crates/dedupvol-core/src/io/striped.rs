//! A striped data device: one address space over the volume's data devices, RAID-0 like.
//!
//! The engine sees one device, the same as a single-device volume: the head (superblocks
//! and, without a metadata device, all metadata) followed by the data region. The head
//! lives on the first device at the same offsets; data unit `u` of the region lives on
//! device `u % N`, row `u / N` (`metadata::stripe` has the picture). Translating here,
//! under `Storage`, rather than in `DataDevice`, keeps every user of the data device
//! (the write path, reads, check, scrub, the tier, the simulator) unchanged: none of them
//! can reach a device byte without the translation, and a request that crosses a unit
//! boundary is split here, the one place that knows where the boundary is.
//!
//! Invariants:
//! - Every member holds `rows` units after its own data start; the device's length is
//!   `head + N * rows * unit` bytes, and nothing beyond it is reachable.
//! - A request is split only at the head's end and at unit boundaries; each piece lies
//!   inside one member's head or data area (asserted at the split).
//! - `sync` syncs every member, even after one of them failed, and fails if any did.
//! - Every byte moved is counted against the member that moved it, as data or head
//!   traffic (`data_devices_io`).

use super::{DataDeviceIo, Storage};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One member device and its traffic.
struct Member {
    dev: Arc<dyn Storage>,
    /// Byte offset of the member's first data unit.
    data_start_bytes: u64,
    data_read_bytes: AtomicU64,
    data_written_bytes: AtomicU64,
    head_read_bytes: AtomicU64,
    head_written_bytes: AtomicU64,
}

/// A device striped over members (see the module comment).
pub struct StripedStorage {
    members: Vec<Member>,
    head_bytes: u64,
    unit_bytes: u64,
    rows: u64,
    len: u64,
}

/// One piece of a split request.
struct Piece {
    member: usize,
    offset: u64,
    range: std::ops::Range<usize>,
    data: bool,
}

impl StripedStorage {
    /// Stripes `members` (the first device first, `members[i].1` its first data byte) in
    /// units of `unit_bytes`, `rows` units each, behind a head of `head_bytes` on the first.
    /// Refuses shapes that cannot hold (no members, a zero unit, a member too small).
    pub fn new(members: Vec<(Arc<dyn Storage>, u64)>, head_bytes: u64, unit_bytes: u64, rows: u64) -> io::Result<Self> {
        let bad = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if members.is_empty() || unit_bytes == 0 || rows == 0 {
            return Err(bad(format!("a stripe of {} devices, {unit_bytes}-byte units, {rows} rows", members.len())));
        }
        let region = (members.len() as u64)
            .checked_mul(rows)
            .and_then(|u| u.checked_mul(unit_bytes))
            .ok_or_else(|| bad("stripe size overflows".into()))?;
        for (i, (dev, start)) in members.iter().enumerate() {
            let need = start.saturating_add(rows.saturating_mul(unit_bytes));
            if dev.len() < need || (i == 0 && *start < head_bytes) {
                return Err(bad(format!(
                    "data device {i} ({}) has {} bytes, the stripe needs {need}",
                    dev.name(),
                    dev.len()
                )));
            }
        }
        let members = members
            .into_iter()
            .map(|(dev, data_start_bytes)| Member {
                dev,
                data_start_bytes,
                data_read_bytes: AtomicU64::new(0),
                data_written_bytes: AtomicU64::new(0),
                head_read_bytes: AtomicU64::new(0),
                head_written_bytes: AtomicU64::new(0),
            })
            .collect();
        Ok(StripedStorage { members, head_bytes, unit_bytes, rows, len: head_bytes + region })
    }

    /// Data devices, the first included.
    pub fn device_count(&self) -> usize {
        self.members.len()
    }

    /// Splits `offset..offset + len` into pieces, each on one member.
    fn split(&self, offset: u64, len: usize) -> io::Result<Vec<Piece>> {
        let end = offset.checked_add(len as u64).filter(|&e| e <= self.len).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("access at {offset}+{len} beyond the striped device's {} bytes", self.len),
            )
        })?;
        let n = self.members.len() as u64;
        let mut pieces = Vec::with_capacity(1);
        let mut pos = offset;
        while pos < end {
            let done = (pos - offset) as usize;
            if pos < self.head_bytes {
                let step = end.min(self.head_bytes) - pos;
                pieces.push(Piece { member: 0, offset: pos, range: done..done + step as usize, data: false });
                pos += step;
                continue;
            }
            let d = pos - self.head_bytes;
            let (unit, within) = (d / self.unit_bytes, d % self.unit_bytes);
            let step = (end - pos).min(self.unit_bytes - within);
            let (member, row) = ((unit % n) as usize, unit / n);
            assert!(row < self.rows, "striped: unit {unit} beyond {} rows", self.rows);
            let start = self.members.get(member).map_or(0, |m| m.data_start_bytes);
            pieces.push(Piece {
                member,
                offset: start + row * self.unit_bytes + within,
                range: done..done + step as usize,
                data: true,
            });
            pos += step;
        }
        Ok(pieces)
    }

    fn member(&self, i: usize) -> io::Result<&Member> {
        self.members.get(i).ok_or_else(|| io::Error::other(format!("striped: no member {i}")))
    }

    fn count(m: &Member, data: bool, write: bool, bytes: usize) {
        let c = match (data, write) {
            (true, false) => &m.data_read_bytes,
            (true, true) => &m.data_written_bytes,
            (false, false) => &m.head_read_bytes,
            (false, true) => &m.head_written_bytes,
        };
        c.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// An error of member `m`, naming it (the engine names only the striped device).
    fn named(i: usize, m: &Member, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("data device {i} ({}): {e}", m.dev.name()))
    }

    fn read_with(
        &self,
        buf: &mut [u8],
        offset: u64,
        read: impl Fn(&dyn Storage, &mut [u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        for p in self.split(offset, buf.len())? {
            let m = self.member(p.member)?;
            let part = buf.get_mut(p.range).ok_or_else(|| io::Error::other("striped: piece outside the buffer"))?;
            Self::count(m, p.data, false, part.len());
            read(m.dev.as_ref(), part, p.offset).map_err(|e| Self::named(p.member, m, e))?;
        }
        Ok(())
    }

    fn for_range(&self, offset: u64, len: u64, f: impl Fn(&dyn Storage, u64, u64)) {
        let Ok(len) = usize::try_from(len) else { return };
        if let Ok(pieces) = self.split(offset, len) {
            for p in pieces {
                if let Some(m) = self.members.get(p.member) {
                    f(m.dev.as_ref(), p.offset, p.range.len() as u64);
                }
            }
        }
    }
}

impl Storage for StripedStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_with(buf, offset, |d, b, o| d.read_at(b, o))
    }
    fn read_cached_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_with(buf, offset, |d, b, o| d.read_cached_at(b, o))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        for p in self.split(offset, buf.len())? {
            let m = self.member(p.member)?;
            let part = buf.get(p.range).ok_or_else(|| io::Error::other("striped: piece outside the buffer"))?;
            Self::count(m, p.data, true, part.len());
            m.dev.write_at(part, p.offset).map_err(|e| Self::named(p.member, m, e))?;
        }
        Ok(())
    }
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        let pieces = self.split(offset, len)?;
        match pieces.as_slice() {
            // The common case: a run inside one unit keeps its single vectored write.
            [p] => {
                let m = self.member(p.member)?;
                Self::count(m, p.data, true, len);
                m.dev.write_vectored_at(bufs, p.offset).map_err(|e| Self::named(p.member, m, e))
            }
            _ => self.write_at(&bufs.concat(), offset),
        }
    }
    fn sync(&self) -> io::Result<()> {
        let mut first_error = None;
        for (i, m) in self.members.iter().enumerate() {
            if let Err(e) = m.dev.sync() {
                first_error.get_or_insert(Self::named(i, m, e));
            }
        }
        first_error.map_or(Ok(()), Err)
    }
    fn start_writeback(&self, offset: u64, len: u64) {
        self.for_range(offset, len, |d, o, l| d.start_writeback(o, l));
    }
    fn is_direct(&self) -> bool {
        self.members.iter().all(|m| m.dev.is_direct())
    }
    fn reads_cached(&self) -> bool {
        self.members.iter().all(|m| m.dev.reads_cached())
    }
    fn drop_cached(&self, offset: u64, len: u64) {
        self.for_range(offset, len, |d, o, l| d.drop_cached(o, l));
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn name(&self) -> String {
        let first = self.members.first().map(|m| m.dev.name()).unwrap_or_default();
        format!("{first} (striped over {} data devices)", self.members.len())
    }
    fn data_devices_io(&self) -> Vec<DataDeviceIo> {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| DataDeviceIo {
                index: i as u32,
                name: m.dev.name(),
                size_bytes: m.dev.len(),
                data_read_bytes: m.data_read_bytes.load(Ordering::Relaxed),
                data_written_bytes: m.data_written_bytes.load(Ordering::Relaxed),
                head_read_bytes: m.head_read_bytes.load(Ordering::Relaxed),
                head_written_bytes: m.head_written_bytes.load(Ordering::Relaxed),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::MemStorage;

    fn striped() -> (StripedStorage, Vec<Arc<MemStorage>>) {
        let mems: Vec<Arc<MemStorage>> = (0..3).map(|_| Arc::new(MemStorage::new(64 << 10))).collect();
        let members = mems
            .iter()
            .enumerate()
            .map(|(i, m)| (m.clone() as Arc<dyn Storage>, if i == 0 { 8192 } else { 4096 }))
            .collect();
        (StripedStorage::new(members, 8192, 16384, 2).expect("stripe"), mems)
    }

    #[test]
    fn units_rotate_over_members_and_requests_split_at_boundaries() {
        let (s, mems) = striped();
        assert_eq!(s.len(), 8192 + 3 * 2 * 16384);
        // Units 0..6, each filled with its number, written in one request.
        let all: Vec<u8> = (0..6u8).flat_map(|u| std::iter::repeat_n(u + 1, 16384)).collect();
        s.write_at(&all, 8192).expect("write");
        for u in 0..6u64 {
            let (m, row) = ((u % 3) as usize, u / 3);
            let start = if m == 0 { 8192 } else { 4096 };
            let mut b = vec![0u8; 16384];
            mems[m].read_at(&mut b, start + row * 16384).expect("read");
            assert!(b.iter().all(|&x| x == u as u8 + 1), "unit {u} on member {m} row {row}");
        }
        let mut back = vec![0u8; all.len()];
        s.read_at(&mut back, 8192).expect("read back");
        assert_eq!(back, all);
        // The head is the first member's, at the same offset.
        s.write_at(&[9; 100], 50).expect("head write");
        let mut h = [0u8; 100];
        mems[0].read_at(&mut h, 50).expect("read");
        assert_eq!(h, [9; 100]);
        assert!(s.write_at(&[0; 1], s.len()).is_err(), "nothing beyond the stripe");
        let io = s.data_devices_io();
        assert_eq!(io.iter().map(|d| d.data_written_bytes).collect::<Vec<_>>(), vec![32768; 3]);
        assert_eq!(io[0].head_written_bytes, 100);
    }

    #[test]
    fn a_member_too_small_is_refused() {
        let mems: Vec<Arc<dyn Storage>> = vec![Arc::new(MemStorage::new(64 << 10)), Arc::new(MemStorage::new(8192))];
        assert!(StripedStorage::new(mems.into_iter().map(|m| (m, 4096)).collect(), 4096, 16384, 2).is_err());
    }
}
