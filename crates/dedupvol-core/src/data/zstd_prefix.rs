//! Decoding the first blocks of a zstd frame, straight into the caller's buffer.
//!
//! Why: a random 4 KiB read of an extent needs block k of its unit, that is the unit's
//! first k + 1 blocks (later blocks may copy from earlier ones, never the reverse). zstd's
//! streaming decoder decodes a whole zstd block into its own window before handing any of
//! it out, and an extent written as one 64 KiB zstd block is then decoded whole and copied
//! once more. Here the frame is decoded zstd block by zstd block (zstd's buffer-less API:
//! the decoder asks for exactly the next input piece and writes the block where the output
//! so far ends), directly into the caller's buffer, and decoding stops once the prefix
//! asked for is out. Extents are written with zstd blocks of at most
//! [`EXTENT_ZSTD_BLOCK_BYTES`] (`packer::compress`), so a read of block k decodes only
//! the zstd blocks up to it.
//!
//! Invariants:
//! - The output buffer is the whole unit (every zstd block of the frame fits where the
//!   decoder puts it); the decoder writes only inside it, and the bytes returned as
//!   decoded are exactly those it wrote.
//! - The frame's content checksum is never computed here (the decoder's context ignores
//!   it): callers check each block they use against its map entry's crc32c.
//! - A frame that ends early, or that the decoder refuses, is an error; nothing past what
//!   was decoded is ever handed out.

use std::mem::MaybeUninit;
use zstd::zstd_safe::zstd_sys as zs;

/// Largest zstd block (of decoded bytes) the writer puts in an extent's frame: a read of
/// block k of a 64 KiB unit then decodes at most `k / 4 + 1` zstd blocks. 16 KiB kept
/// the ratio of 64 KiB blocks on a /usr tar and on generated text (within 0.4 %), where
/// 4 KiB blocks lost 1–3 %.
pub const EXTENT_ZSTD_BLOCK_BYTES: u32 = 16 << 10;

/// A decoder context of this thread's own (zstd contexts are not shared between threads).
/// Why not `zstd_safe::DCtx`: it exposes no buffer-less calls nor its raw context.
struct Dctx(*mut zs::ZSTD_DCtx);

impl Drop for Dctx {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `ZSTD_createDCtx` and is freed once, here.
        unsafe {
            zs::ZSTD_freeDCtx(self.0);
        }
    }
}

impl Dctx {
    fn new() -> Option<Dctx> {
        // SAFETY: creating a context has no preconditions; a null result is checked.
        let raw = unsafe { zs::ZSTD_createDCtx() };
        if raw.is_null() {
            return None;
        }
        let d = Dctx(raw);
        // SAFETY: `raw` is a live context; the parameter is a documented one.
        let r = unsafe { zs::ZSTD_DCtx_setParameter(raw, zs::ZSTD_dParameter::ZSTD_d_experimentalParam3, 1) };
        // ZSTD_d_experimentalParam3 is ZSTD_d_forceIgnoreChecksum (zstd.h).
        if is_error(r) {
            return None;
        }
        Some(d)
    }
}

fn is_error(code: usize) -> bool {
    // SAFETY: a pure function of its argument.
    unsafe { zs::ZSTD_isError(code) != 0 }
}

fn error_name(code: usize) -> String {
    zstd::zstd_safe::get_error_name(code).to_string()
}

/// Decodes the zstd frame `frame` into `out` until at least `want` bytes are out or the
/// frame ends; returns the bytes decoded (the first that many of `out` are initialised).
/// `out` must hold the frame's whole content (the unit). A damaged or truncated frame is
/// an error.
pub(crate) fn decode_prefix(frame: &[u8], out: &mut [MaybeUninit<u8>], want: usize) -> Result<usize, String> {
    thread_local! {
        static DCTX: std::cell::RefCell<Option<Dctx>> = const { std::cell::RefCell::new(None) };
    }
    DCTX.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            *cell = Dctx::new();
        }
        let Some(d) = cell.as_ref() else { return Err("no zstd context".to_string()) };
        // SAFETY: `d.0` is this thread's live context.
        let r = unsafe { zs::ZSTD_decompressBegin(d.0) };
        if is_error(r) {
            return Err(error_name(r));
        }
        let (mut read, mut written) = (0usize, 0usize);
        while written < want {
            // SAFETY: a live context.
            let n = unsafe { zs::ZSTD_nextSrcSizeToDecompress(d.0) };
            if n == 0 {
                break; // the frame ended
            }
            let Some(piece) = frame.get(read..read + n) else {
                return Err(format!("frame ends after {} bytes, {n} more expected", frame.len()));
            };
            let room = out.len() - written;
            // SAFETY: `written <= out.len()` (checked below after every step), so the
            // destination pointer and `room` describe the unwritten end of `out`; zstd
            // writes at most `room` bytes there and reads `n` bytes of `piece`. The bytes
            // before it, which the block may copy from, are this frame's earlier output,
            // where the buffer-less API requires them to stay.
            let r = unsafe {
                zs::ZSTD_decompressContinue(d.0, out.as_mut_ptr().add(written).cast(), room, piece.as_ptr().cast(), n)
            };
            if is_error(r) {
                return Err(error_name(r));
            }
            if r > room {
                return Err(format!("decoder wrote {r} bytes into room for {room}"));
            }
            read += n;
            written += r;
        }
        Ok(written)
    })
}

/// `decode_prefix` into a new buffer of `unit` bytes; returns it holding the decoded
/// bytes only (at least `want` of them unless the frame is shorter).
pub(crate) fn decode_prefix_vec(frame: &[u8], unit: usize, want: usize) -> Result<Vec<u8>, String> {
    let mut v: Vec<u8> = Vec::with_capacity(unit);
    let n = decode_prefix(frame, v.spare_capacity_mut(), want.min(unit))?;
    // SAFETY: `decode_prefix` initialised the first `n <= unit` bytes of the spare
    // capacity (it returns only bytes zstd wrote).
    unsafe { v.set_len(n) };
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(data: &[u8], block: u32) -> Vec<u8> {
        let mut c = zstd::bulk::Compressor::new(1).expect("compressor");
        c.include_checksum(true).expect("checksum");
        if block > 0 {
            c.set_parameter(zstd::zstd_safe::CParameter::MaxBlockSize(block)).expect("block size");
        }
        c.compress(data).expect("compress")
    }

    fn text(n: usize) -> Vec<u8> {
        let words = [&b"alpha "[..], b"beta ", b"gamma ", b"delta ", b"epsilon "];
        let mut x = 7u64;
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(words[(x % 5) as usize]);
            v.push((x >> 8) as u8);
        }
        v.truncate(n);
        v
    }

    #[test]
    fn every_prefix_of_small_and_large_block_frames_decodes_to_the_data() {
        let data = text(64 << 10);
        for block in [0u32, EXTENT_ZSTD_BLOCK_BYTES, 4096] {
            let f = frame(&data, block);
            for k in 1..=16 {
                let want = k * 4096;
                let got = decode_prefix_vec(&f, data.len(), want).expect("decodes");
                assert!(got.len() >= want, "block size {block}: {} bytes for a prefix of {want}", got.len());
                assert_eq!(got.as_slice(), &data[..got.len()], "block size {block}, prefix {want}");
                if block == EXTENT_ZSTD_BLOCK_BYTES {
                    // Decoding stops at the zstd block holding the prefix's end.
                    assert_eq!(got.len(), want.next_multiple_of(EXTENT_ZSTD_BLOCK_BYTES as usize));
                }
            }
        }
    }

    #[test]
    fn damaged_and_truncated_frames_are_errors_and_never_overrun() {
        let data = text(64 << 10);
        let f = frame(&data, EXTENT_ZSTD_BLOCK_BYTES);
        assert!(decode_prefix_vec(&f[..f.len() / 2], data.len(), data.len()).is_err(), "a truncated frame decoded");
        assert!(decode_prefix_vec(&f[..3], data.len(), 4096).is_err(), "a bare header decoded");
        // Too little room for the frame's blocks: refused, not overrun.
        assert!(decode_prefix_vec(&f, 8192, 8192).is_err(), "a frame decoded into half a block of room");
        let mut bad = f.clone();
        for b in bad.iter_mut().skip(20).step_by(97) {
            *b ^= 0x5a;
        }
        match decode_prefix_vec(&bad, data.len(), data.len()) {
            Err(_) => {}
            // zstd may decode damaged sequences into other bytes: never into the data.
            Ok(v) => assert_ne!(v.as_slice(), &data[..v.len()], "damage went unnoticed"),
        }
        // Random bytes are not a frame.
        let junk = crate::codec::test_random_bytes(5, 4096);
        assert!(decode_prefix_vec(&junk, data.len(), 4096).is_err());
    }
}
