//! How much memory this process may use: the machine's, or less when a memory cgroup
//! limits it. `serve --cache-size auto` sizes the content cache from it.
//!
//! Invariants:
//! - Never larger than the machine's memory; a cgroup limit above it ("no limit") is ignored.
//! - Unreadable sources count as "no limit" from that source, never as zero.

/// Share of the memory limit an automatically sized content cache takes (ZFS's ARC takes
/// up to a half; a quarter leaves the page cache, the index and other processes room).
const AUTO_CACHE_SHARE_DIVISOR: u64 = 4;
/// Smallest automatically sized content cache.
const AUTO_CACHE_BYTES_MIN: u64 = 64 << 20;
/// Largest automatically sized content cache.
const AUTO_CACHE_BYTES_MAX: u64 = 64 << 30;

/// A `/proc/meminfo` figure (`MemTotal`, `MemAvailable`, ...) in bytes, if known.
fn meminfo_bytes(field: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.strip_prefix(field).is_some_and(|rest| rest.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// The machine's memory (`MemTotal`), if known.
fn mem_total_bytes() -> Option<u64> {
    meminfo_bytes("MemTotal")
}

/// Memory the kernel says can be allocated without swapping (`MemAvailable`), if known.
pub(crate) fn mem_available_bytes() -> Option<u64> {
    meminfo_bytes("MemAvailable")
}

/// The memory limit of this process's cgroup (v1 `memory.limit_in_bytes` or v2
/// `memory.max`), if any.
fn cgroup_limit_bytes() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<u64> = None;
    for line in groups.lines() {
        // "4:memory:/path" (v1) or "0::/path" (v2).
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else {
            continue;
        };
        if let Some(v) = std::fs::read_to_string(file).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
            best = Some(best.map_or(v, |b| b.min(v)));
        }
    }
    best
}

/// Memory this process may use: the machine's, or its cgroup's limit when lower.
pub(crate) fn memory_limit_bytes() -> Option<u64> {
    match (mem_total_bytes(), cgroup_limit_bytes()) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    }
}

/// The content cache `--cache-size auto` gives: a quarter of the memory limit, within
/// 64 MiB..64 GiB (64 MiB when the limit is unknown).
pub(crate) fn auto_cache_bytes() -> u64 {
    memory_limit_bytes()
        .map_or(AUTO_CACHE_BYTES_MIN, |m| m / AUTO_CACHE_SHARE_DIVISOR)
        .clamp(AUTO_CACHE_BYTES_MIN, AUTO_CACHE_BYTES_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_cache_is_a_bounded_share_of_known_memory() {
        let limit = memory_limit_bytes().expect("this machine reports its memory");
        assert!(limit <= mem_total_bytes().expect("MemTotal"), "the limit never exceeds the machine");
        let c = auto_cache_bytes();
        assert!((AUTO_CACHE_BYTES_MIN..=AUTO_CACHE_BYTES_MAX).contains(&c));
        assert!(c <= (limit / AUTO_CACHE_SHARE_DIVISOR).max(AUTO_CACHE_BYTES_MIN));
    }
}
