//! A volume's life: format, open (superblocks, recovery, state), close.
//!
//! Invariants:
//! - Format writes the metadata device's superblocks, then each extra data device's header,
//!   before the first data device's superblocks: a crash mid-format leaves the data device
//!   unformatted, never pointing at a half-made volume.
//! - A striped volume opens only with every extra data device present, in its place and
//!   of this volume (`assemble_stripe` checks each header before anything is written).
//! - Open changes nothing on the devices until everything it must allocate (the
//!   fingerprint index) is allocated and the journal is replayed: a failed open leaves
//!   the volume as it was.
//! - A read-write open marks the volume not clean (superblock) before any data write;
//!   only `close` marks it clean again, after a checkpoint (which also writes the open
//!   chapter of the fingerprint index).

use super::state::State;
use super::Volume;
use crate::config::{DedupVerify, FormatOptions, OpenOptions, BLOCK_SIZE_U64};
use crate::data::packer::Packer;
use crate::data::placement::DataDevice;
use crate::data::staging::Staging;
use crate::data::writer::{DataWriter, Health, Tickets};
use crate::dedup::chapter::RingLayout;
use crate::dedup::index::Index;
use crate::dedup::Deduper;
use crate::error::{Error, Result};
use crate::io::{Dev, FileStorage, IoCounters, IoKind, IoMode, RadosStorage, RadosUrl, Storage, StripedStorage};
use crate::metadata::allocator::Allocator;
use crate::metadata::layout::{Geometry, GrowthRoom};
use crate::metadata::stripe::{
    MemberHeader, StripeLayout, DATA_DEVICES_MAX, MEMBER_DATA_START_BLOCKS, STRIPE_PATH_BYTES_MAX, STRIPE_UNIT_BLOCKS,
};
use crate::metadata::superblock::Superblock;
use crate::obs::stats::{LifetimeCounters, ReductionCounters};
use crate::pipeline::executor::CpuPool;
use crate::read::cache::ContentCache;
use crate::sync::Mutex;
use crate::tier::Tier;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A volume's data device and, when it has one, its metadata device.
pub(crate) type Devices = (Arc<dyn Storage>, Option<Arc<dyn Storage>>);

/// Something opening the volume noticed, for `check`.
#[derive(Debug, Clone)]
pub(crate) enum OpenNote {
    /// A superblock copy is unreadable or damaged (the other one was used): a problem,
    /// which `check --repair` fixes by rewriting both copies.
    SuperblockCopy(String),
    /// Harmless and informational: torn journal blocks, pages rebuilt from the journal,
    /// a saved index ignored.
    Info(String),
}

fn new_uuid() -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    h.update(&now.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    let local = 0u8;
    h.update(&(std::ptr::addr_of!(local) as usize).to_le_bytes());
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let mut r = [0u8; 16];
        if std::io::Read::read_exact(&mut f, &mut r).is_ok() {
            h.update(&r);
        }
    }
    let mut u = [0u8; 16];
    u.copy_from_slice(h.finalize().as_bytes().get(..16).unwrap_or(&[0u8; 16]));
    u
}

/// The low 64 bits of a uuid: stamped into every metadata page to tell volumes apart.
pub(crate) fn uuid_lo(u: &[u8; 16]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(u.get(..8).unwrap_or(&[0u8; 8]));
    u64::from_le_bytes(b)
}

/// Formats a UUID as hex.
pub fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

impl Volume {
    /// Formats `data` (and `meta`, when given) as a new, empty volume. Refuses to overwrite
    /// an existing volume unless `force`.
    pub fn format(
        data: Arc<dyn Storage>,
        meta: Option<Arc<dyn Storage>>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        Self::format_with_hint(data, Vec::new(), meta, opts, force, None)
    }

    /// Formats a volume whose data region is striped over `data` and the `extra` data
    /// devices, each given with the path the superblock records for it (`open_path`
    /// opens it by that path).
    pub fn format_striped(
        data: Arc<dyn Storage>,
        extra: Vec<(Arc<dyn Storage>, String)>,
        meta: Option<Arc<dyn Storage>>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        Self::format_with_hint(data, extra, meta, opts, force, None)
    }

    /// Formats a new volume:
    /// 1. the geometry, for the whole data capacity when striped (`stripe_geometry`);
    /// 2. the metadata device's superblocks; 3. each extra data device's header;
    /// 4. the first data device's superblocks, last, so that a crash before them leaves
    ///    no volume behind.
    fn format_with_hint(
        data: Arc<dyn Storage>,
        extra: Vec<(Arc<dyn Storage>, String)>,
        meta: Option<Arc<dyn Storage>>,
        opts: &FormatOptions,
        force: bool,
        meta_path: Option<String>,
    ) -> Result<()> {
        opts.validate()?;
        if extra.len() + 1 > DATA_DEVICES_MAX {
            return Err(Error::InvalidArgument(format!(
                "{} data devices given; a volume stripes over at most {DATA_DEVICES_MAX}",
                extra.len() + 1
            )));
        }
        if let Some((_, p)) = extra.iter().find(|(_, p)| p.is_empty() || p.len() > STRIPE_PATH_BYTES_MAX) {
            return Err(Error::InvalidArgument(format!(
                "data device path {p:?} must be 1 to {STRIPE_PATH_BYTES_MAX} bytes long (the superblock records it)"
            )));
        }
        if let Some(machine) = crate::io::hugemem::physical_memory_bytes().filter(|&m| opts.index_memory_bytes > m) {
            // A bound this machine could never honour is a mistake, not a setting.
            return Err(Error::InvalidArgument(format!(
                "index memory {} exceeds this machine's {machine} bytes of memory",
                opts.index_memory_bytes
            )));
        }
        let io = Arc::new(IoCounters::default());
        let data = Dev::new(data, io.clone());
        let extra: Vec<(Dev, String)> = extra.into_iter().map(|(d, p)| (Dev::new(d, io.clone()), p)).collect();
        let meta = meta.map(|m| Dev::new(m, io));
        if !force {
            for dev in std::iter::once(&data).chain(meta.iter()).chain(extra.iter().map(|(d, _)| d)) {
                if Superblock::probe(dev)? {
                    return Err(Error::AlreadyFormatted(dev.name()));
                }
            }
        }
        // Metadata is sized for every data device's bytes (an upper bound on the region).
        let data_bytes = data.len() + extra.iter().map(|(d, _)| d.len()).sum::<u64>();
        let window_blocks = window_blocks(opts, data_bytes / BLOCK_SIZE_U64);
        let logical_blocks = opts.logical_size_bytes / BLOCK_SIZE_U64;
        let layout = |room| {
            Geometry::compute_with_room(
                logical_blocks,
                data_bytes,
                meta.as_ref().map(|m| m.len()),
                opts.slab_size_bytes / BLOCK_SIZE_U64,
                opts.journal_size_bytes,
                RingLayout::blocks_for_window(window_blocks, opts.index_mode, true),
                room,
            )
        };
        let default_room = GrowthRoom::default_for(
            logical_blocks,
            data_bytes / BLOCK_SIZE_U64,
            meta.as_ref().map(|m| m.len() / BLOCK_SIZE_U64),
        );
        let geo = match (opts.max_logical_size_bytes, opts.max_physical_size_bytes) {
            // Room asked for must fit, or the format fails.
            (None, None) => layout(default_room).or_else(|_| layout(GrowthRoom::NONE))?,
            (l, p) => layout(GrowthRoom {
                max_logical_blocks: l.map_or(default_room.max_logical_blocks, |b| b / BLOCK_SIZE_U64),
                max_data_dev_blocks: p.map_or(default_room.max_data_dev_blocks, |b| b / BLOCK_SIZE_U64),
            })?,
        };
        let (geo, stripe) = if extra.is_empty() {
            (geo, None)
        } else {
            let (g, s) = stripe_geometry(geo, &data, &extra)?;
            (g, Some(s))
        };
        let memory = RingLayout::for_area(geo.index_start, geo.index_blocks, opts.index_mode, true)
            .map_or(0, |r| Index::memory_wanted(opts.index_mode, &r));
        if memory > opts.index_memory_bytes {
            return Err(Error::InvalidArgument(format!(
                "a dedup window of {} bytes ({} index) needs {memory} bytes of index memory, more than the {} allowed (--index-memory)",
                window_blocks * BLOCK_SIZE_U64,
                opts.index_mode,
                opts.index_memory_bytes
            )));
        }
        if let Some(machine) = crate::io::hugemem::physical_memory_bytes().filter(|&m| memory > m) {
            // A volume whose index cannot be allocated here could never be opened here.
            return Err(Error::InvalidArgument(format!(
                "the fingerprint index needs {memory} bytes of memory, more than this machine's {machine}"
            )));
        }
        let sb = Superblock {
            uuid: new_uuid(),
            generation: 1,
            compression: opts.compression,
            compression_level: opts.compression_level,
            rest_level: opts.effective_rest_level(),
            dedup: opts.dedup,
            verify: opts.verify,
            write_policy: opts.write_policy,
            clean: true,
            geometry: geo,
            index_memory_bytes: opts.index_memory_bytes,
            index_mode: opts.index_mode,
            index_names: true,
            // 0 (none set: the largest) stays what volumes without a choice record.
            extent_blocks_max: match opts.effective_extent_blocks_max() {
                crate::metadata::block_map::UNIT_BLOCKS_MAX if opts.extent_blocks_max.is_none() => 0,
                b => b,
            },
            next_entry_seq: 1,
            next_block_seq: 0,
            mapped_blocks: 0,
            zero_blocks: 0,
            index_saved_entries: 0,
            meta_path,
            lifetime: LifetimeCounters::default(),
            stripe,
            dictionary: None,
        };
        if let Some(m) = &meta {
            write_copies(m, &sb, 1)?;
        }
        if let Some(stripe) = &sb.stripe {
            for (i, (dev, _)) in extra.iter().enumerate() {
                let header = MemberHeader::for_device(sb.uuid, i as u32 + 1, stripe).encode();
                dev.write(IoKind::Superblock, &header, 0)?;
                dev.write(IoKind::Superblock, &vec![0u8; crate::config::BLOCK_SIZE], BLOCK_SIZE_U64)?;
                dev.sync()?;
            }
        }
        write_copies(&data, &sb, 0)
    }

    /// Formats a file or block device by path; `physical_size` creates or extends a file.
    pub fn format_path(
        path: &Path,
        physical_size: Option<u64>,
        meta_device: Option<&Path>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        Self::format_path_striped(path, &[], physical_size, meta_device, opts, force)
    }

    /// Formats a volume striped over `path` and the `extra` data devices (files or block
    /// devices; `physical_size` creates or extends each file to that size, as for `path`).
    pub fn format_path_striped(
        path: &Path,
        extra: &[std::path::PathBuf],
        physical_size: Option<u64>,
        meta_device: Option<&Path>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        // Recorded as typed for a RADOS URL, else by absolute path (of its folder, for a
        // file not created yet).
        let recorded = |p: &Path| {
            if RadosUrl::parse(p).is_some() {
                return Some(p.to_path_buf());
            }
            std::fs::canonicalize(p).ok().or_else(|| {
                let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                Some(std::fs::canonicalize(parent).ok()?.join(p.file_name()?))
            })
        };
        // Every device once, checked before any is opened (a second open of one file
        // would meet the first one's lock and blame another process).
        let mut seen: Vec<std::path::PathBuf> = Vec::with_capacity(extra.len() + 2);
        for p in std::iter::once(path).chain(meta_device).chain(extra.iter().map(|p| p.as_path())) {
            let abs = recorded(p).ok_or_else(|| {
                Error::InvalidArgument(format!("device {}: cannot find its absolute path", p.display()))
            })?;
            if seen.contains(&abs) {
                return Err(Error::InvalidArgument(format!(
                    "{} is given twice (as the volume's path, a data device or the metadata device)",
                    p.display()
                )));
            }
            seen.push(abs);
        }
        let data = crate::io::create_device(path, physical_size)?;
        let mut extra_devs = Vec::with_capacity(extra.len());
        for p in extra {
            let dev = crate::io::create_device(p, physical_size)?;
            let abs = recorded(p).ok_or_else(|| {
                Error::InvalidArgument(format!("data device {}: cannot find its absolute path", p.display()))
            })?;
            extra_devs.push((dev, abs.display().to_string()));
        }
        let meta = match meta_device {
            Some(m) => Some(crate::io::open_device(m, false, IoMode::Direct, false)?),
            None => None,
        };
        // A RADOS URL is recorded as typed; a file by its absolute path.
        let hint = meta_device.and_then(recorded).map(|p| p.display().to_string());
        Self::format_with_hint(data, extra_devs, meta, opts, force, hint)
    }

    /// Opens a volume by path. A volume formatted with a metadata device remembers its path;
    /// `meta_device` overrides it.
    pub fn open_path(path: &Path, meta_device: Option<&Path>, opts: &OpenOptions) -> Result<Volume> {
        let (data, meta) = Self::devices_at(path, meta_device, opts)?;
        Self::open(data, meta, opts)
    }

    /// The data device at `path` and the metadata device (`meta_device`, else the path
    /// recorded at format), opened as `opts` says.
    pub(crate) fn devices_at(path: &Path, meta_device: Option<&Path>, opts: &OpenOptions) -> Result<Devices> {
        let (data, sb, mode): (Arc<dyn Storage>, _, _) = match RadosUrl::parse(path) {
            Some(url) => {
                let data: Arc<dyn Storage> = Arc::new(RadosStorage::open(&url?, opts.read_only, opts.take_over)?);
                let sb = Superblock::read(&Dev::new(data.clone(), Arc::new(IoCounters::default())), 0)?.0;
                // No page cache in front of RADOS: a local metadata file is opened direct.
                let mode = opts.io_mode.for_verify(true);
                (data, sb, mode)
            }
            None => {
                let file = Arc::new(FileStorage::open_with(path, opts.read_only, opts.io_mode)?);
                let sb = {
                    let dev = Dev::new(file.clone(), Arc::new(IoCounters::default()));
                    Superblock::read(&dev, 0)?.0
                };
                // `auto` resolves from the volume: byte verification reads every candidate,
                // and the page cache serves those reads from RAM; hash verification reads
                // nothing.
                let mode = opts.io_mode.for_verify(sb.verify == DedupVerify::Hash);
                let file = Arc::try_unwrap(file).map_err(|_| {
                    Error::internal("device still shared after reading its superblock", path.display().to_string())
                })?;
                (Arc::new(if mode == IoMode::Buffered { file.into_buffered() } else { file }), sb, mode)
            }
        };
        let data = match &sb.stripe {
            Some(stripe) => assemble_stripe(data, &sb, stripe, |_, p| {
                crate::io::open_device(Path::new(p), opts.read_only, mode, opts.take_over)
            })?,
            None => data,
        };
        let meta_path = match meta_device {
            Some(m) => Some(m.to_path_buf()),
            None if sb.geometry.meta_dev_blocks > 0 => match sb.meta_path {
                Some(p) => Some(std::path::PathBuf::from(p)),
                None => {
                    return Err(Error::InvalidArgument(
                        "this volume keeps its metadata on a separate device: pass --meta-device".into(),
                    ))
                }
            },
            None => None,
        };
        let meta: Option<Arc<dyn Storage>> = match meta_path {
            Some(m) => Some(crate::io::open_device(&m, opts.read_only, mode, opts.take_over)?),
            None => None,
        };
        Ok((data, meta))
    }

    /// The data device of the volume at `path` as the engine addresses it: the device
    /// itself, or, for a volume striped over several devices, the stripe over all of them
    /// (found by the paths in its superblock and checked against their headers). For tools
    /// that take devices (`check_volume`); `open_path` does this itself.
    pub fn open_data_path(path: &Path, read_only: bool, mode: IoMode) -> Result<Arc<dyn Storage>> {
        let data = crate::io::open_device(path, read_only, mode, false)?;
        let sb = Superblock::read(&Dev::new(data.clone(), Arc::new(IoCounters::default())), 0)?.0;
        match &sb.stripe {
            Some(stripe) => {
                assemble_stripe(data, &sb, stripe, |_, p| crate::io::open_device(Path::new(p), read_only, mode, false))
            }
            None => Ok(data),
        }
    }

    /// The stripe over a striped volume's devices given in hand (`first`, then the extra
    /// devices in their order), each checked against its header as `open_path` does: for
    /// in-memory devices and tests. `Volume::open` and `check_volume` take the result.
    pub fn stripe_devices(first: Arc<dyn Storage>, extra: Vec<Arc<dyn Storage>>) -> Result<Arc<dyn Storage>> {
        let sb = Superblock::read(&Dev::new(first.clone(), Arc::new(IoCounters::default())), 0)?.0;
        let Some(stripe) = &sb.stripe else {
            return Err(Error::InvalidArgument(format!("volume {} has one data device", uuid_hex(&sb.uuid))));
        };
        if extra.len() + 1 != stripe.device_count() {
            return Err(Error::InvalidArgument(format!(
                "volume {} is striped over {} data devices, {} given",
                uuid_hex(&sb.uuid),
                stripe.device_count(),
                extra.len() + 1
            )));
        }
        assemble_stripe(first, &sb, stripe, |i, p| {
            extra.get(i).cloned().ok_or_else(|| Error::InvalidArgument(format!("no device given for {p}")))
        })
    }

    /// Opens a volume, replaying the journal if it was not closed cleanly:
    /// 1. superblocks of both devices (`open_devices`);
    /// 2. the fingerprint index is allocated (nothing written yet);
    /// 3. recovery: journal replay into the block map and reference counts, made durable
    ///    in their pages (`recover`);
    /// 4. the in-memory state; the fingerprint index's newest chapter found and its
    ///    rebuild from the chapter ring started (in the background by default; it only
    ///    reads, so a read-only open does it too, for its statistics); the data writer.
    pub fn open(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Volume> {
        let io = Arc::new(IoCounters::default());
        let (data, meta, mut sb, mut notes) = open_devices(data, meta, &io)?;
        let geo = sb.geometry;
        let ulo = uuid_lo(&sb.uuid);
        // Before anything decodes a fragment (recovery, the tier, reads): fragments at rest
        // may need the volume's dictionary.
        let dictionary = match sb.dictionary {
            Some(info) => {
                let d = Arc::new(crate::data::dictionary::read(&meta, &geo.dict_area(), &info)?);
                crate::data::dictionary::register(&d)?;
                Some(d)
            }
            None => None,
        };
        // Allocated before anything is written: an index this machine cannot hold is a
        // clear error that leaves the volume exactly as it was, and `index_memory_bytes`
        // can lower it.
        let hash_mode = sb.verify == DedupVerify::Hash;
        let memory = opts.index_memory_bytes.unwrap_or(sb.index_memory_bytes);
        let index = Index::new(
            sb.index_mode,
            Some(meta.clone()),
            (geo.index_start, geo.index_blocks, sb.index_names),
            ulo,
            memory,
            !opts.read_only,
        )?;
        let mut rec = super::recovery::recover(&data, &meta, &mut sb, opts.read_only, opts.block_map_cache_bytes)?;
        rec.rc.set_cap(opts.refcount_cap);
        notes.extend(rec.notes.into_iter().map(OpenNote::Info));
        let mut dedup = Deduper::new(index, hash_mode, geo.data_blocks);
        if sb.dedup {
            // Recovery counted this open (and made it durable) before anything is written.
            dedup.index_mut().rebuild(sb.lifetime.read_write_opens, opts.index_rebuild);
        }
        let mut state = State {
            alloc: Allocator::from_counts(rec.rc.counts(), geo.slab_blocks),
            map: rec.map,
            rc: rec.rc,
            journal: rec.journal,
            packer: Packer::new(),
            dedup,
            counters: rec.counters,
            red: ReductionCounters::default(),
            staging: Staging::default(),
            cleaner_window: 0,
            // Unknown: fragments of another codec may be left from an earlier session.
            fast_codec_hint: u64::MAX,
        };
        let data = DataDevice::new(data, &geo);
        let tickets = Arc::new(Tickets::default());
        let health = Arc::new(Health::default());
        let writer = (!opts.read_only && opts.background_writes)
            .then(|| DataWriter::start(data.clone(), tickets.clone(), health.clone()))
            .flatten();
        // After recovery: entries found on the tier are kept only for referenced blocks.
        let mut tier_notes = Vec::new();
        let tier =
            opts.tier.as_ref().and_then(|t| Tier::open(t, &sb.uuid, data.clone(), state.rc.counts(), &mut tier_notes));
        notes.extend(tier_notes.iter().cloned().map(OpenNote::Info));
        let woj = crate::woj::Woj::new(opts.woj, opts.woj_weak_hash_mask, geo.logical_blocks * BLOCK_SIZE_U64);
        // The unique-chunk predictor needs fingerprints (dedup) and a stage 1 of its own,
        // which write-once journaling's stage 1 is not.
        let predictor = (sb.dedup && woj.is_none() && opts.unique_predictor && !opts.read_only)
            .then(|| Mutex::new(crate::dedup::predictor::Predictor::new(state.dedup.index().capacity())));
        let defer =
            (opts.defer_compression_micros > 0 && sb.compression == crate::config::Compression::Zstd).then(|| {
                Arc::new(crate::pipeline::defer::Deferral::new(
                    sb.compression,
                    opts.defer_compression_micros,
                    opts.defer_fixed_cost_ns,
                ))
            });
        let exec = match opts.workers {
            Some(n) => Arc::new(CpuPool::with_workers(n)),
            None => CpuPool::shared(),
        };
        // A backend's fingerprints are not proof of equality: every candidate of the
        // session is verified by its bytes (docs/design.md, "The offload interface").
        if opts.offload.is_some() {
            state.dedup.distrust();
        }
        let v = Volume {
            predictor,
            defer,
            woj: woj.map(Mutex::new),
            data,
            meta,
            geo,
            logical_blocks: std::sync::atomic::AtomicU64::new(geo.logical_blocks),
            policy: opts.write_policy.unwrap_or(sb.write_policy),
            dedup: sb.dedup,
            compression: opts.store_codec.map_or(sb.compression, |(c, _)| c),
            compression_level: opts.store_codec.map_or_else(
                || crate::config::effective_level(sb.compression, sb.compression_level),
                |(c, l)| crate::config::effective_level(c, l),
            ),
            volume_codec: (sb.compression, crate::config::effective_level(sb.compression, sb.compression_level)),
            rest_level: std::sync::atomic::AtomicI8::new(sb.rest_level),
            reads_served: std::sync::atomic::AtomicU64::new(0),
            cache_writes: opts.writes_cached(sb.verify),
            extent_blocks_max: std::sync::atomic::AtomicU8::new(super::extent_setting(sb.extent_blocks_max)),
            extent_open_cap: opts.extent_blocks_max.clamp(1, crate::metadata::block_map::UNIT_BLOCKS_MAX),
            dictionary: Mutex::new(dictionary),
            dictionary_tried: AtomicBool::new(false),
            dictionary_train_min: opts.dictionary_train_min_bytes,
            lifetime_base: sb.lifetime,
            sb: Mutex::new(sb),
            state: parking_lot::Mutex::new(state),
            commit_lock: Mutex::new(()),
            tickets,
            writer,
            exec: exec.clone(),
            offload: crate::pipeline::offload::Offloader::new(exec, opts.offload.clone()),
            batcher: crate::pipeline::batcher::Batcher::new(crate::pipeline::batcher::BatchOptions {
                // The backend's batch size hint, unless the caller chose.
                chunks_wanted: match (opts.batch.chunks_wanted, &opts.offload) {
                    (0, Some(o)) => o.capacity().batch_chunks,
                    (w, _) => w,
                },
                ..opts.batch
            }),
            cache: Mutex::new(ContentCache::new(opts.content_cache_bytes)),
            rmw: std::array::from_fn(|_| Mutex::new(())),
            io,
            read_only: opts.read_only,
            health,
            journal_pressure: AtomicBool::new(false),
            open_notes: notes,
            tier,
            tier_notes,
            scrub: Mutex::new(None),
        };
        // After recovery, before any write: the journal of a file system already there.
        v.woj_discover();
        Ok(v)
    }

    /// Makes everything durable, writes all metadata and marks the volume clean.
    pub fn close(self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_not_failed()?;
        let _c = self.commit_lock.lock();
        let mut st = self.state.lock();
        // A rebuild still under way stops: the chapters it did not read stay on the device
        // for the next open.
        st.dedup.index_mut().stop_rebuild();
        st.dedup.index_mut().prepare_close();
        self.checkpoint(&mut st)?;
        let mut sb = self.sb.lock();
        sb.clean = true;
        // The chapter ring replaced the index saved at close; the field stays zero.
        sb.index_saved_entries = 0;
        sb.next_entry_seq = st.journal.next_entry_seq();
        sb.next_block_seq = st.journal.next_block_seq();
        self.set_counters(&mut sb, &st);
        write_superblock(self.data.dev(), self.separate_meta(), &mut sb)
    }

    /// Writes the superblock copies with the lifetime counters as of now (after a
    /// checkpoint; close writes them too), so a crash loses at most the counts since the
    /// last checkpoint. Rare enough to cost nothing: a checkpoint frees half the journal.
    /// The space counters as of the checkpoint go with them: a crash whose first journal
    /// block after the checkpoint was torn replays nothing, and recovery then takes them
    /// from here (the blocks that carried them are behind the journal's head).
    pub(crate) fn persist_counters(&self, st: &State) -> Result<()> {
        assert_eq!(st.journal.pending_len(), 0, "space counters persisted with journal entries not committed");
        let mut sb = self.sb.lock();
        self.set_counters(&mut sb, st);
        write_superblock(self.data.dev(), self.separate_meta(), &mut sb)
    }

    /// The superblock's counters as of now: the lifetime counters and the space counters
    /// (mapped and zero blocks), which match the block map once the journal holds nothing
    /// uncommitted.
    fn set_counters(&self, sb: &mut Superblock, st: &State) {
        sb.lifetime = self.lifetime_now(st);
        sb.mapped_blocks = st.counters.mapped_blocks;
        sb.zero_blocks = st.counters.zero_blocks;
    }

    /// The metadata device when it is not the data device.
    pub(crate) fn separate_meta(&self) -> Option<&Dev> {
        (self.geo.meta_dev_blocks > 0).then_some(&self.meta)
    }
}

/// Data blocks the fingerprint index is to cover: the window asked for, else what the
/// index memory can index (dense: one slot per block; sparse: one per hook), at most the
/// data device (a larger window would only index overwritten data).
fn window_blocks(opts: &FormatOptions, data_dev_blocks: u64) -> u64 {
    if let Some(w) = opts.dedup_window_bytes {
        return w / BLOCK_SIZE_U64;
    }
    let slots = opts.index_memory_bytes / crate::dedup::volume_index::SLOT_BYTES;
    let entries = slots * crate::dedup::volume_index::LOAD_PERCENT / 100;
    let blocks = match opts.index_mode {
        crate::config::IndexMode::Dense => entries,
        crate::config::IndexMode::Sparse => entries * crate::dedup::index::SPARSE_SAMPLE,
    };
    blocks.min(data_dev_blocks).max(1)
}

/// Reads the superblocks of the data device and, when the volume has one, the metadata
/// device, and checks that they belong together and are large enough.
pub(crate) fn open_devices(
    data: Arc<dyn Storage>,
    meta: Option<Arc<dyn Storage>>,
    io: &Arc<IoCounters>,
) -> Result<(Dev, Dev, Superblock, Vec<OpenNote>)> {
    let data = Dev::new(data, io.clone());
    let (sb, data_notes) = Superblock::read(&data, 0)?;
    let mut notes: Vec<OpenNote> = data_notes.into_iter().map(OpenNote::SuperblockCopy).collect();
    let geo = sb.geometry;
    let striped_devices = data.data_devices_io().len();
    match &sb.stripe {
        Some(s) if striped_devices != s.device_count() => {
            return Err(Error::InvalidArgument(format!(
                "volume {} is striped over {} data devices; open it by its first device's path, which finds the others",
                uuid_hex(&sb.uuid),
                s.device_count()
            )))
        }
        None if striped_devices > 0 => {
            return Err(Error::InvalidArgument(format!(
                "volume {} has one data device, but was given a stripe of {striped_devices}",
                uuid_hex(&sb.uuid)
            )))
        }
        _ => {}
    }
    let separate = geo.meta_dev_blocks > 0;
    let meta = match (meta, separate) {
        (Some(m), true) => {
            let m = Dev::new(m, io.clone());
            let (msb, mnotes) = Superblock::read(&m, 1)?;
            if msb.uuid != sb.uuid {
                return Err(Error::NotAVolume(format!(
                    "metadata device {} belongs to volume {}, not {}",
                    m.name(),
                    uuid_hex(&msb.uuid),
                    uuid_hex(&sb.uuid)
                )));
            }
            notes.extend(mnotes.into_iter().map(OpenNote::SuperblockCopy));
            m
        }
        (None, true) => {
            return Err(Error::InvalidArgument(
                "this volume keeps its metadata on a separate device, which was not given".into(),
            ))
        }
        (Some(_), false) => {
            return Err(Error::InvalidArgument("this volume has no separate metadata device".into()));
        }
        (None, false) => data.clone(),
    };
    let recorded = [(&data, geo.data_dev_blocks), (&meta, if separate { geo.meta_dev_blocks } else { 0 })];
    for (dev, blocks) in recorded {
        if dev.len() < blocks * BLOCK_SIZE_U64 {
            return Err(Error::corruption(
                "device block count",
                blocks,
                format!("device {} to hold the {blocks} blocks its superblock records", dev.name()),
                format!(
                    "{} blocks: smaller than the volume's recorded geometry (was it truncated?)",
                    dev.len() / BLOCK_SIZE_U64
                ),
            ));
        }
    }
    Ok((data, meta, sb, notes))
}

/// The geometry of a striped volume from the one `Geometry` computed for all its data
/// bytes: the same metadata regions (sized for an upper bound of the data region), and a
/// data region of the units every device can hold, the same number on each.
fn stripe_geometry(geo: Geometry, first: &Dev, extra: &[(Dev, String)]) -> Result<(Geometry, StripeLayout)> {
    let unit = STRIPE_UNIT_BLOCKS;
    let rows_on = |dev: &Dev, start: u64| (dev.len() / BLOCK_SIZE_U64).saturating_sub(start) / unit;
    let mut rows = rows_on(first, geo.data_start);
    let mut smallest = first.name();
    for (dev, _) in extra {
        let r = rows_on(dev, MEMBER_DATA_START_BLOCKS);
        if r < rows {
            rows = r;
            smallest = dev.name();
        }
    }
    if rows == 0 {
        return Err(Error::InvalidArgument(format!(
            "data device {smallest} is too small: each data device must hold one {}-byte stripe unit after its \
             header (the first device also holds the superblocks and metadata: {} bytes)",
            unit * BLOCK_SIZE_U64,
            geo.data_start * BLOCK_SIZE_U64
        )));
    }
    let stripe = StripeLayout {
        unit_blocks: unit,
        rows,
        member_data_start: MEMBER_DATA_START_BLOCKS,
        paths: extra.iter().map(|(_, p)| p.clone()).collect(),
    };
    let mut g = geo;
    g.data_blocks = stripe.device_count() as u64 * rows * unit;
    g.data_dev_blocks = g.data_start + g.data_blocks;
    // The refcount pages were sized for every device's blocks, at least the region.
    g.validate().map_err(|e| Error::internal("striped geometry breaks its invariants", e.to_string()))?;
    stripe.validate(&g).map_err(|e| Error::internal("stripe breaks its invariants", e.to_string()))?;
    Ok((g, stripe))
}

/// The stripe over `first` and the extra devices the superblock names (opened with
/// `open`), after checking each device's header: a device that cannot be opened, is too
/// small, or whose header names another volume or another place is refused with an error
/// naming it, and nothing is written.
fn assemble_stripe(
    first: Arc<dyn Storage>,
    sb: &Superblock,
    stripe: &StripeLayout,
    open: impl Fn(usize, &str) -> Result<Arc<dyn Storage>>,
) -> Result<Arc<dyn Storage>> {
    let n = stripe.device_count();
    let mut members: Vec<(Arc<dyn Storage>, u64)> = Vec::with_capacity(n);
    members.push((first, sb.geometry.data_start * BLOCK_SIZE_U64));
    for (i, path) in stripe.paths.iter().enumerate() {
        let index = i as u32 + 1;
        let refuse = |reason: String| Error::DataDevice {
            index,
            count: n as u32,
            path: path.clone(),
            volume: uuid_hex(&sb.uuid),
            reason,
        };
        let dev = open(i, path).map_err(|e| refuse(format!("cannot be opened: {e}")))?;
        let mut block = vec![0u8; crate::config::BLOCK_SIZE];
        Dev::new(dev.clone(), Arc::new(IoCounters::default()))
            .read(IoKind::Superblock, &mut block, 0)
            .map_err(|e| refuse(format!("its header cannot be read: {e}")))?;
        let found = MemberHeader::decode(&block).map_err(|e| refuse(format!("block 0 holds {e}")))?;
        found.check(&MemberHeader::for_device(sb.uuid, index, stripe)).map_err(refuse)?;
        if dev.len() < stripe.member_blocks() * BLOCK_SIZE_U64 {
            return Err(refuse(format!(
                "it has {} bytes, the stripe needs {} (was it truncated?)",
                dev.len(),
                stripe.member_blocks() * BLOCK_SIZE_U64
            )));
        }
        members.push((dev, stripe.member_data_start * BLOCK_SIZE_U64));
    }
    let s = StripedStorage::new(
        members,
        sb.geometry.data_start * BLOCK_SIZE_U64,
        stripe.unit_blocks * BLOCK_SIZE_U64,
        stripe.rows,
    )
    .map_err(|e| Error::NotAVolume(format!("volume {}: {e}", uuid_hex(&sb.uuid))))?;
    Ok(Arc::new(s))
}

/// Writes a new generation of the superblock: the metadata device's copies first (when
/// separate), then the data device's, in the order `format` writes them.
pub(crate) fn write_superblock(data: &Dev, meta: Option<&Dev>, sb: &mut Superblock) -> Result<()> {
    sb.generation += 1;
    if let Some(m) = meta {
        write_copies(m, sb, 1)?;
    }
    write_copies(data, sb, 0)
}

/// Writes both superblock copies, each followed by a sync, the stale one first: the copy
/// that holds the newest valid superblock now is made durable, then overwritten last, so a
/// crash that tears one write always leaves one valid copy. (A fixed A-then-B order loses
/// both when B was torn by one crash and A by the next.)
fn write_copies(dev: &Dev, sb: &Superblock, role: u8) -> Result<()> {
    let buf = sb.encode(role);
    // A copy that cannot be read or decoded counts as stale.
    let newest = Superblock::read_copy(dev, role).ok().map(|(_, copy, _)| copy);
    let order = if newest == Some(0) { [1u64, 0] } else { [0u64, 1] };
    // The copy read back as valid may only be in the device's volatile cache (its write's
    // sync failed before): make it durable before the other copy is overwritten, or a
    // crash could tear one and lose the other.
    dev.sync()?;
    for copy in order {
        dev.write(IoKind::Superblock, &buf, copy * BLOCK_SIZE_U64)?;
        dev.sync()?;
    }
    Ok(())
}
