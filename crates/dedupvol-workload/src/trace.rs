//! The FIU block trace format (the SyLab FIU traces: homes, web-vm, mail): a streaming
//! parser and the writer of one record line.
//!
//! One record per line, nine whitespace-separated fields:
//!
//! ```text
//! ts pid process lba size op major minor md5
//! 89286854133 5359 syslogd 1078456 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c
//! ```
//!
//! `ts` is in nanoseconds (an integer; a decimal number is accepted and rounded), `lba` and
//! `size` are in 512-byte sectors, `op` is `R` or `W` (either case), `md5` is the 32-hex
//! digest of the record's content. A process name containing spaces is accepted: the
//! first two and last six fields are positional, everything between is the name.
//!
//! How records become 4 KiB blocks (the engine's dedup unit):
//! - A record covers the blocks `lba / 8 .. ceil((lba + size) / 8)`: a record that is not
//!   4 KiB aligned is rounded out to whole blocks, as a 4 KiB-block device would have to
//!   read-modify-write them. A record of size 0 covers no block.
//! - Block `k` of a record (counted from its first block) has the content key
//!   `(md5, k)`. In the real traces almost every record is one block and the md5 is of
//!   that 4 KiB; for a record of N blocks with one md5, the N blocks are taken as N
//!   different contents that repeat exactly where the same md5 and position repeat. Giving
//!   all N blocks the same content instead would invent dedup inside every large record.
//!
//! Invariants:
//! - Memory is bounded: the reader holds one line of at most [`LINE_BYTES_MAX`] bytes; a
//!   record may cover at most [`RECORD_BYTES_MAX`] bytes, so a consumer that buffers a
//!   record's data is bounded too.
//! - Bad input never panics: every error names the file and the 1-based line number, and
//!   the reader yields nothing after its first error.
//! - Blank lines and lines starting with `#` are skipped (the real files have no comments;
//!   generated ones start with a comment naming their parameters).

use crate::rng::mix64;
use std::fmt;
use std::io::{BufRead, Read};

/// Bytes in a trace sector.
pub const SECTOR_BYTES: u64 = 512;
/// Bytes in a block (the engine's dedup unit).
pub const TRACE_BLOCK_BYTES: u64 = 4096;
/// Sectors in a block.
pub const BLOCK_SECTORS: u64 = TRACE_BLOCK_BYTES / SECTOR_BYTES;
/// Longest accepted line, in bytes (real lines are under 100).
pub const LINE_BYTES_MAX: usize = 4096;
/// Largest record, in bytes (the NBD server's request bound): a replayer holds a record's
/// data in memory.
pub const RECORD_BYTES_MAX: u64 = 32 << 20;

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceOp {
    /// A read.
    Read,
    /// A write.
    Write,
}

/// One parsed trace record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRecord {
    /// 1-based line number in its file (for error messages).
    pub line: u64,
    /// Timestamp, in nanoseconds.
    pub ts_ns: u64,
    /// Process id.
    pub pid: u64,
    /// Process name.
    pub process: String,
    /// First sector.
    pub lba_sectors: u64,
    /// Length, in sectors.
    pub size_sectors: u64,
    /// Read or write.
    pub op: TraceOp,
    /// Device major number.
    pub major: u32,
    /// Device minor number.
    pub minor: u32,
    /// The md5 of the record's content.
    pub md5: [u8; 16],
}

impl TraceRecord {
    /// First 4 KiB block the record touches.
    pub fn first_block(&self) -> u64 {
        self.lba_sectors / BLOCK_SECTORS
    }

    /// Number of 4 KiB blocks the record touches (rounded out to whole blocks).
    pub fn block_count(&self) -> u64 {
        if self.size_sectors == 0 {
            return 0;
        }
        // Checked at parse time: lba + size fits in u64 sectors.
        let end = (self.lba_sectors + self.size_sectors).div_ceil(BLOCK_SECTORS);
        end - self.first_block()
    }

    /// Content key of block `k` of the record: equal keys mean equal 4 KiB contents.
    pub fn content_key(&self, k: u64) -> u64 {
        content_key(&self.md5, k)
    }

    /// The record as one FIU line (no newline).
    pub fn to_line(&self) -> String {
        let op = match self.op {
            TraceOp::Read => 'R',
            TraceOp::Write => 'W',
        };
        format!(
            "{} {} {} {} {} {} {} {} {}",
            self.ts_ns,
            self.pid,
            self.process,
            self.lba_sectors,
            self.size_sectors,
            op,
            self.major,
            self.minor,
            hex(&self.md5)
        )
    }
}

/// The content key of block `k` of a record with digest `md5`.
pub fn content_key(md5: &[u8; 16], k: u64) -> u64 {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&md5[..8]);
    hi.copy_from_slice(&md5[8..]);
    mix64(mix64(u64::from_le_bytes(lo), u64::from_le_bytes(hi)), k)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What is wrong with a trace line.
#[derive(Debug)]
pub enum TraceErrorKind {
    /// Reading the file failed.
    Io(std::io::Error),
    /// The line is longer than [`LINE_BYTES_MAX`].
    LineTooLong,
    /// The line is not UTF-8.
    NotUtf8,
    /// Fewer than nine fields.
    FieldCount {
        /// Fields found.
        found: usize,
    },
    /// A field does not parse.
    BadField {
        /// The field's name.
        field: &'static str,
        /// Its text.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The record ends past the last addressable sector.
    Overflow,
    /// The record is larger than [`RECORD_BYTES_MAX`].
    RecordTooLarge {
        /// Its size, in bytes, after rounding out to 4 KiB blocks.
        bytes: u64,
    },
}

/// A trace error: which file, which line, what.
#[derive(Debug)]
pub struct TraceError {
    /// The file (as given by the caller).
    pub path: String,
    /// 1-based line number (0: before the first line).
    pub line: u64,
    /// What went wrong.
    pub kind: TraceErrorKind,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: ", self.path, self.line)?;
        match &self.kind {
            TraceErrorKind::Io(e) => write!(f, "reading the trace: {e}"),
            TraceErrorKind::LineTooLong => write!(f, "line longer than {LINE_BYTES_MAX} bytes"),
            TraceErrorKind::NotUtf8 => write!(f, "line is not UTF-8 text"),
            TraceErrorKind::FieldCount { found } => {
                write!(f, "{found} fields, expected 9 (ts pid process lba size op major minor md5)")
            }
            TraceErrorKind::BadField { field, value, expected } => {
                write!(f, "field {field} is {value:?}, expected {expected}")
            }
            TraceErrorKind::Overflow => write!(f, "lba + size overflows the sector range"),
            TraceErrorKind::RecordTooLarge { bytes } => {
                write!(f, "record of {bytes} bytes is larger than the {RECORD_BYTES_MAX}-byte maximum")
            }
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            TraceErrorKind::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// Parses one non-blank line (without its newline) into a record.
pub fn parse_line(text: &str, line: u64) -> Result<TraceRecord, TraceErrorKind> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let n = fields.len();
    if n < 9 {
        return Err(TraceErrorKind::FieldCount { found: n });
    }
    let bad = |field: &'static str, value: &str, expected: &'static str| TraceErrorKind::BadField {
        field,
        value: value.chars().take(64).collect(),
        expected,
    };
    let tail = &fields[n - 6..];
    let ts_ns = parse_ts(fields[0]).ok_or_else(|| bad("ts", fields[0], "nanoseconds (a non-negative number)"))?;
    let pid = fields[1].parse().map_err(|_| bad("pid", fields[1], "an integer"))?;
    let process = fields[2..n - 6].join(" ");
    let lba_sectors: u64 = tail[0].parse().map_err(|_| bad("lba", tail[0], "a sector number"))?;
    let size_sectors: u64 = tail[1].parse().map_err(|_| bad("size", tail[1], "a sector count"))?;
    let op = match tail[2] {
        "R" | "r" => TraceOp::Read,
        "W" | "w" => TraceOp::Write,
        other => return Err(bad("op", other, "R or W")),
    };
    let major = tail[3].parse().map_err(|_| bad("major", tail[3], "an integer"))?;
    let minor = tail[4].parse().map_err(|_| bad("minor", tail[4], "an integer"))?;
    let md5 = parse_md5(tail[5]).ok_or_else(|| bad("md5", tail[5], "32 hex digits"))?;
    let end = lba_sectors.checked_add(size_sectors).ok_or(TraceErrorKind::Overflow)?;
    if end.checked_add(BLOCK_SECTORS).is_none() {
        return Err(TraceErrorKind::Overflow);
    }
    let record = TraceRecord { line, ts_ns, pid, process, lba_sectors, size_sectors, op, major, minor, md5 };
    let bytes = record.block_count() * TRACE_BLOCK_BYTES;
    if bytes > RECORD_BYTES_MAX {
        return Err(TraceErrorKind::RecordTooLarge { bytes });
    }
    Ok(record)
}

fn parse_ts(s: &str) -> Option<u64> {
    if let Ok(v) = s.parse::<u64>() {
        return Some(v);
    }
    let f: f64 = s.parse().ok()?;
    // u64::MAX as f64 rounds up to 2^64, so compare strictly below it.
    (f.is_finite() && f >= 0.0 && f < u64::MAX as f64).then(|| f.round() as u64)
}

fn parse_md5(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = (b[2 * i] as char).to_digit(16)?;
        let lo = (b[2 * i + 1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(out)
}

/// A streaming reader of FIU records: an iterator of `Result<TraceRecord, TraceError>`.
pub struct TraceReader<R> {
    input: R,
    path: String,
    line: u64,
    buf: Vec<u8>,
    failed: bool,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads records from `input`; `path` names it in errors.
    pub fn new(input: R, path: impl Into<String>) -> Self {
        TraceReader { input, path: path.into(), line: 0, buf: Vec::with_capacity(256), failed: false }
    }

    fn error(&mut self, kind: TraceErrorKind) -> Option<Result<TraceRecord, TraceError>> {
        self.failed = true;
        Some(Err(TraceError { path: self.path.clone(), line: self.line, kind }))
    }
}

impl TraceReader<std::io::BufReader<std::fs::File>> {
    /// Opens a trace file.
    pub fn open(path: &std::path::Path) -> Result<Self, TraceError> {
        let f = std::fs::File::open(path).map_err(|e| TraceError {
            path: path.display().to_string(),
            line: 0,
            kind: TraceErrorKind::Io(e),
        })?;
        Ok(TraceReader::new(std::io::BufReader::with_capacity(1 << 20, f), path.display().to_string()))
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        loop {
            self.buf.clear();
            self.line += 1;
            // One byte more than the bound: a longer line is seen without reading it all.
            let limit = LINE_BYTES_MAX as u64 + 1;
            let n = match (&mut self.input).take(limit).read_until(b'\n', &mut self.buf) {
                Ok(n) => n,
                Err(e) => return self.error(TraceErrorKind::Io(e)),
            };
            if n == 0 {
                return None;
            }
            if self.buf.last() == Some(&b'\n') {
                self.buf.pop();
            } else if self.buf.len() > LINE_BYTES_MAX {
                return self.error(TraceErrorKind::LineTooLong);
            }
            let text = match std::str::from_utf8(&self.buf) {
                Ok(t) => t.trim(),
                Err(_) => return self.error(TraceErrorKind::NotUtf8),
            };
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            return match parse_line(text, self.line) {
                Ok(r) => Some(Ok(r)),
                Err(kind) => self.error(kind),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str) -> Vec<Result<TraceRecord, TraceError>> {
        TraceReader::new(text.as_bytes(), "t.txt").collect()
    }

    #[test]
    fn real_looking_lines_parse() {
        let text = "89286854133 5359 syslogd 1078456 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n\
                    \n\
                    89286870712 4472 gzip 6711480 8 r 6 0 58D6A5C48B8AA2FBA41B1C87A76D2C8F\r\n\
                    1.5e3 1 my proc 16 8 W 6 0 00000000000000000000000000000000";
        let recs: Vec<TraceRecord> = read_all(text).into_iter().map(|r| r.expect("record")).collect();
        assert_eq!(recs.len(), 3);
        assert_eq!(recs[0].ts_ns, 89_286_854_133);
        assert_eq!(recs[0].pid, 5359);
        assert_eq!(recs[0].process, "syslogd");
        assert_eq!(recs[0].op, TraceOp::Write);
        assert_eq!(recs[0].first_block(), 1_078_456 / 8);
        assert_eq!(recs[0].block_count(), 1);
        assert_eq!(recs[0].md5[0], 0x53);
        assert_eq!(recs[1].line, 3);
        assert_eq!(recs[1].op, TraceOp::Read);
        assert_eq!(recs[1].md5[15], 0x8f);
        assert_eq!(recs[2].ts_ns, 1500);
        assert_eq!(recs[2].process, "my proc");
        assert_eq!(recs[2].line, 4);
        // A record written back out parses to the same record.
        let again = parse_line(&recs[0].to_line(), 1).expect("round trip");
        assert_eq!(again, recs[0]);
    }

    #[test]
    fn multi_block_and_unaligned_records_round_out() {
        let md5 = "0123456789abcdef0123456789abcdef";
        let r = parse_line(&format!("0 1 p 64 32 W 8 0 {md5}"), 1).expect("record");
        assert_eq!((r.first_block(), r.block_count()), (8, 4));
        // Blocks of one record differ; the same md5 and position give the same key.
        assert_ne!(r.content_key(0), r.content_key(1));
        let s = parse_line(&format!("5 1 p 800 8 W 8 0 {md5}"), 2).expect("record");
        assert_eq!(r.content_key(0), s.content_key(0));
        // Sectors 3..12 touch blocks 0 and 1.
        let u = parse_line(&format!("0 1 p 3 9 R 8 0 {md5}"), 3).expect("record");
        assert_eq!((u.first_block(), u.block_count()), (0, 2));
        let z = parse_line(&format!("0 1 p 3 0 R 8 0 {md5}"), 4).expect("record");
        assert_eq!(z.block_count(), 0);
    }

    #[test]
    fn bad_lines_name_file_line_and_field() {
        let good = "1 2 p 8 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n";
        let cases = [
            ("1 2 p 8 8 W 6 0\n", "t.txt:2: 8 fields, expected 9"),
            ("1 2 p 8 8 X 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n", "t.txt:2: field op is \"X\", expected R or W"),
            ("1 2 p 8 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8\n", "t.txt:2: field md5"),
            ("1 2 p 8 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67bzz\n", "t.txt:2: field md5"),
            ("-4 2 p 8 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n", "t.txt:2: field ts"),
            ("1 2 p x 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n", "t.txt:2: field lba"),
            ("1 2 p 18446744073709551615 8 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n", "t.txt:2: lba + size overflows"),
            ("1 2 p 0 999999999 W 6 0 531e779c6b2e9b1c1c3c30d9b6a67b8c\n", "t.txt:2: record of"),
        ];
        for (bad, want) in cases {
            let text = format!("{good}{bad}{good}");
            let got = read_all(&text);
            assert_eq!(got.len(), 2, "{bad}: the reader must stop after the error");
            let e = got[1].as_ref().expect_err("an error").to_string();
            assert!(e.starts_with(want), "{bad}: got {e:?}, want {want:?}");
        }
        let long = format!("{good}{}\n", "9".repeat(LINE_BYTES_MAX + 10));
        let e = read_all(&long).pop().expect("item").expect_err("too long").to_string();
        assert!(e.starts_with("t.txt:2: line longer than"), "{e}");
        let bin = [good.as_bytes(), &[0xff, 0xfe, b'\n']].concat();
        let e: Vec<_> = TraceReader::new(&bin[..], "t.txt").collect();
        assert!(e[1].as_ref().expect_err("not utf-8").to_string().contains("not UTF-8"));
    }
}
