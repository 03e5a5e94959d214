//! `Block`: an immutable, shared 4 KiB block — the content cache's entries, staged
//! writes on their way to the data device, and the pieces of read replies.
//!
//! Invariants:
//! - The bytes have an allocation of their own, of exactly their length; the reference
//!   counts live in a second, small one. `Arc<[u8]>` puts its 16 bytes of counts in front
//!   of the data: 4,112 bytes, which a size-class allocator (jemalloc's classes go 4 KiB,
//!   5 KiB, ...) rounds up to 5 KiB, so a cache of N bytes of blocks took 1.25 N of memory.
//! - A block never changes once shared: `get_mut` gives its bytes only while this handle
//!   is the sole one (a block being filled right after `zeroed`).

use std::ops::Deref;
use std::sync::Arc;

/// An immutable, shared block of bytes (4 KiB everywhere the engine makes one).
#[derive(Clone, PartialEq, Eq)]
pub struct Block(Arc<Box<[u8]>>);

impl Block {
    /// A zeroed, unshared block of `len` bytes.
    pub fn zeroed(len: usize) -> Block {
        Block(Arc::new(vec![0u8; len].into_boxed_slice()))
    }

    /// The bytes, while this is the only handle on them (a block being filled).
    pub fn get_mut(&mut self) -> Option<&mut [u8]> {
        Arc::get_mut(&mut self.0).map(|b| &mut **b)
    }

    /// Where the reference counts live: what a reader about to use the block prefetches.
    pub(crate) fn header_ptr(&self) -> *const u8 {
        Arc::as_ptr(&self.0).cast::<u8>()
    }

    /// True when both handles share one allocation.
    pub fn ptr_eq(a: &Block, b: &Block) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl Deref for Block {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::borrow::Borrow<[u8]> for Block {
    fn borrow(&self) -> &[u8] {
        self
    }
}

impl From<&[u8]> for Block {
    fn from(bytes: &[u8]) -> Block {
        Block(Arc::new(Box::from(bytes)))
    }
}

impl From<Vec<u8>> for Block {
    /// Takes the vector's allocation when it holds exactly its length (no copy).
    fn from(bytes: Vec<u8>) -> Block {
        Block(Arc::new(bytes.into_boxed_slice()))
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_shares_its_bytes_and_is_writable_only_alone() {
        let mut a = Block::zeroed(4096);
        a.get_mut().expect("sole handle").fill(7);
        let b = a.clone();
        assert!(Block::ptr_eq(&a, &b));
        assert_eq!(&b[..3], &[7, 7, 7]);
        let mut c = b.clone();
        assert!(c.get_mut().is_none(), "a shared block must not change");
        drop((a, b));
        assert!(c.get_mut().is_some());
        assert_eq!(Block::from(vec![1u8; 4096]), Block::from(&[1u8; 4096][..]));
        assert_eq!(format!("{:?}", Block::from(&[0u8; 8][..])), "Block(8 bytes)");
    }
}
