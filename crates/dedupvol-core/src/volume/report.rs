//! What a volume reports about itself: statistics, memory by structure, lifetime
//! counters, and the in-memory audits tests and the simulator run: `audit_memory` (every
//! mapping against its stored content) and, with the `verify` feature,
//! `audit_structures` (each structure against its own invariants, also run at every
//! checkpoint).

use super::lifecycle::uuid_hex;
use super::state::State;
use super::Volume;
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::packer;
use crate::io::IoKind;
use crate::obs::stats::{LifetimeCounters, Savings, Stats};

impl Volume {
    /// Memory held by the volume's structures now, in bytes, by structure.
    pub fn memory_usage(&self) -> Vec<(&'static str, u64)> {
        let st = self.state.lock();
        let blocks = self.data.blocks();
        let mut v = vec![
            ("reference + fragment counts", 2 * blocks),
            ("allocator bitmap", blocks.div_ceil(64) * 8),
            ("reuse stamps", st.dedup.stamp_bytes()),
            ("fingerprint volume index", st.dedup.index().memory_bytes()),
            ("fingerprint record cache (records held now)", st.dedup.index().cache_bytes()),
            ("block map cache (pages held now)", st.map.cached_pages() as u64 * BLOCK_SIZE_U64),
            ("content cache (blocks held now)", self.cache.lock().len() as u64 * BLOCK_SIZE_U64),
        ];
        if let Some(t) = &self.tier {
            let (table, queue) = t.memory_bytes();
            v.push(("hot-chunk tier slot table and map", table));
            v.push(("hot-chunk tier queue and recent reads", queue));
        }
        if let Some(p) = &self.predictor {
            v.push(("unique-chunk predictor", p.lock().stats.memory_bytes));
        }
        if let Some(w) = &self.woj {
            v.push(("write-once journaling pool", w.lock().snapshot().pool_bytes));
        }
        v
    }

    /// Audits the in-memory structures against each other and every mapping against its
    /// stored content; for tests and the simulator. Returns the first violation.
    pub fn audit_memory(&self) -> std::result::Result<(), String> {
        let mut st = self.state.lock();
        // The structure audits include the allocator's; without them it runs alone.
        #[cfg(feature = "verify")]
        self.audit_structures(&st)?;
        #[cfg(not(feature = "verify"))]
        st.alloc.audit(st.rc.counts(), &st.packer.open_pbns())?;
        // Every mapping's content, read from the device (or memory when unwritten), must
        // match its checksum: the cache must never hide a divergence.
        for lba in 0..self.logical_blocks() {
            let e = st.map.get(lba).map_err(|e| e.to_string())?;
            if !e.is_data() {
                continue;
            }
            let mut out = vec![0u8; BLOCK_SIZE];
            let ok = match st.unwritten(&e, &mut out) {
                Some(ok) => ok,
                None => {
                    let mut b = vec![0u8; BLOCK_SIZE * e.span() as usize];
                    self.data.read(IoKind::Verify, e.pbn, &mut b, "block map entry").map_err(|e| e.to_string())?;
                    match e.fragment_of() {
                        None => {
                            out = b;
                            true
                        }
                        Some(f) => packer::decode_block(e.pbn, &f, &b, &mut out).is_ok(),
                    }
                }
            };
            if !ok || crc32c::crc32c(&out) != e.crc {
                return Err(format!(
                    "lba {lba} -> {e:?}: device content does not match (open packed blocks {:?})",
                    st.packer.open_pbns()
                ));
            }
        }
        Ok(())
    }

    /// Audits every structure under the state lock against its own invariants and the
    /// allocator against the reference counts (the `verify` feature: whole-structure
    /// scans, too slow for production). Returns the first violation, named by structure.
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit_structures(&self, st: &State) -> std::result::Result<(), String> {
        let named = |what: &'static str| move |m: String| format!("{what}: {m}");
        st.journal.audit().map_err(named("journal"))?;
        st.map.audit().map_err(named("block map"))?;
        st.rc.audit().map_err(named("reference counts"))?;
        st.alloc.audit(st.rc.counts(), &st.packer.open_pbns()).map_err(named("allocator"))?;
        st.packer.audit().map_err(named("packer"))?;
        st.staging.audit().map_err(named("staging"))?;
        st.dedup.audit(self.data.blocks()).map_err(named("dedup index"))?;
        // Innermost lock (volume lock order): taken alone under the state lock.
        self.cache.lock().audit().map_err(named("content cache"))?;
        if let Some(t) = &self.tier {
            t.audit().map_err(named("hot-chunk tier"))?;
        }
        if let Some(w) = &self.woj {
            w.lock().audit().map_err(named("write-once journaling pool"))?;
        }
        Ok(())
    }

    /// A statistics snapshot.
    pub fn stats(&self) -> Stats {
        let sb = self.sb.lock().clone();
        let st = self.state.lock();
        let mut red = st.red.clone();
        {
            let c = self.cache.lock();
            red.content_cache_hits = c.hits();
            red.content_cache_misses = c.misses();
        }
        red.block_map_cache_hits = st.map.hits();
        red.block_map_cache_misses = st.map.misses();
        let used = st.rc.used_blocks();
        let mapped = st.counters.mapped_blocks;
        // Live blocks that share stored data, estimated from the volume's whole life: the
        // share of its data writes that were duplicates. (Counts are kept per physical
        // block, which fragments share, so the exact figure would need a scan of the map.)
        let life = self.lifetime_now(&st);
        let data_written = life.blocks_written.saturating_sub(life.zero_blocks);
        let shared = if data_written == 0 {
            0
        } else {
            (u128::from(mapped) * u128::from(life.dedup_hits.min(data_written)) / u128::from(data_written)) as u64
        };
        let logical_used = mapped * BLOCK_SIZE_U64;
        let physical_used = used * BLOCK_SIZE_U64;
        let index = st.dedup.index();
        Stats {
            uuid: uuid_hex(&sb.uuid),
            logical_size_bytes: self.logical_size(),
            logical_bytes_used: logical_used,
            physical_size_bytes: self.data.dev().len(),
            data_blocks_total: self.data.blocks(),
            data_blocks_used: used,
            physical_data_bytes_used: physical_used,
            metadata_bytes: sb.geometry.metadata_bytes(),
            separate_metadata_device: self.geo.meta_dev_blocks > 0,
            reduction_ratio: if physical_used == 0 { 0.0 } else { logical_used as f64 / physical_used as f64 },
            savings: Savings {
                zero_bytes: st.counters.zero_blocks * BLOCK_SIZE_U64,
                dedup_bytes: shared * BLOCK_SIZE_U64,
                compression_bytes: (mapped - shared).saturating_sub(used) * BLOCK_SIZE_U64,
            },
            lifetime: self.lifetime_now(&st),
            counters: red,
            index_entries: index.len(),
            index_capacity: index.capacity(),
            index_memory_bytes: index.memory_bytes(),
            index_bytes_per_entry: index.bytes_per_entry(),
            index: index.stats(),
            block_map_cached_pages: st.map.cached_pages() as u64,
            compression: sb.compression,
            compression_level: crate::config::effective_level(sb.compression, sb.compression_level),
            rest_level: sb.rest_level,
            extent_blocks_max: self.extent_max(),
            dictionary: sb.dictionary.map(|d| (d.id, d.len)),
            dictionary_area: self.geo.dict_blocks > 0,
            dedup: sb.dedup,
            verify: sb.verify,
            write_policy: self.policy,
            io: self.io.snapshot(),
            data_devices: self.data.dev().data_devices_io(),
            tier: self.tier.as_ref().map(|t| t.stats()),
            scrub: self.scrub_status(),
            woj: self.woj.as_ref().map(|w| w.lock().snapshot()),
            pipeline: {
                let mut p = self.batcher.stats();
                if let Some(pr) = &self.predictor {
                    p.predictor = pr.lock().stats;
                }
                if let Some(d) = &self.defer {
                    p.deferral = d.stats();
                }
                p.offload = self.offload.stats();
                p
            },
        }
    }

    /// The lifetime counters as of now: those loaded at open plus this process's.
    pub(crate) fn lifetime_now(&self, st: &State) -> LifetimeCounters {
        self.lifetime_base.plus_process(&st.red, &self.io.snapshot())
    }
}
