//! The read side: the content cache.

pub(crate) mod cache;
