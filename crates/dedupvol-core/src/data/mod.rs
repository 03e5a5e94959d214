//! Data placement: the packer of compressed fragments, and the writer of data blocks.

pub(crate) mod packer;
pub(crate) mod writer;
