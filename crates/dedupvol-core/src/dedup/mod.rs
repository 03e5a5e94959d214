//! Deduplication: the fingerprint index.

pub(crate) mod index;
