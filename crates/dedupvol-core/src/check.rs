//! (being written)
use crate::error::Result;
use crate::storage::Storage;
use std::sync::Arc;

/// Result of auditing a closed volume.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckReport {
    /// Problems found (empty when clean).
    pub problems: Vec<String>,
    /// What `repair` fixed.
    pub repaired: Vec<String>,
    /// What could not be repaired.
    pub unrepaired: Vec<String>,
}

impl CheckReport {
    /// True when nothing is wrong.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Audits a closed volume.
pub fn check_volume(_data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>, _repair: bool) -> Result<CheckReport> {
    Err(crate::Error::InvalidArgument("check not yet implemented".into()))
}
