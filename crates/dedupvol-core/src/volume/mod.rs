//! The volume: the reduction pipeline on top of the metadata structures, and the public
//! read / write / flush / discard / write-zeroes API.
//!
//! Write path, per request (4 KiB chunks):
//! 1. without locks: zero check, BLAKE3 fingerprint, crc32c of the content;
//! 2. under the state lock: index lookups (candidates);
//! 3. without locks: verify candidates (content cache or a verification read, then a byte
//!    compare) and compress the chunks that have no verified duplicate;
//! 4. under the state lock: place new data (packer or raw block), write it, then journal
//!    and apply every mapping change (block map + refcounts).
//!
//! Invariants:
//! - Data a visible mapping references is on the device (written, not necessarily synced)
//!   or held in memory by `staged` / `writing`, which answer reads and verifications for
//!   it; a commit writes the staged data, waits for every earlier write in flight, syncs
//!   data, then writes the journal blocks, and syncs them before reporting durability
//!   (docs/design.md, durability contract).
//! - Lock order: `commit_lock` before `state`; `tickets` and `cache` are taken alone
//!   (innermost). Full staging batches are written by the data-writer thread
//!   (`data_writer`), which takes no volume lock.
//! - After a failed device write or sync the volume is "failed": it refuses writes, since
//!   what reached the device is unknown (a failed fsync is never retried and assumed good).
//! - The content a block map entry points to always hashes (crc32c) to the entry's crc; a
//!   read that finds otherwise retries once from the mapping, then reports corruption.

use crate::config::{Compression, DedupVerify, FormatOptions, OpenOptions, WritePolicy, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::packer::{self, Packer};
use crate::data::writer::{write_merged, write_ticketed, DataWriter, Health, Tickets};
use crate::dedup::index::{Index, Location};
use crate::error::{Error, Result};
use crate::io::{Dev, FileStorage, IoCounters, IoKind, Storage};
use crate::metadata::allocator::Allocator;
use crate::metadata::block_map::{BlockMap, MapEntry, STATE_RAW};
use crate::metadata::journal::{self, CommitBatch, Counters, Journal};
use crate::metadata::layout::Geometry;
use crate::metadata::refcount::{Refcounts, REFCOUNT_MAX};
use crate::metadata::superblock::Superblock;
use crate::obs::stats::{LifetimeCounters, ReductionCounters, Savings, Stats};
use crate::read::cache::{Block, ContentCache};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Stripes of the read-modify-write lock (unaligned writes to one block are serialised).
const RMW_STRIPES: usize = 64;
/// Blocks handled per state-lock hold for discard / write-zeroes of large ranges.
const UNMAP_BLOCKS_PER_LOCK: u64 = 8192;
/// Raw blocks read with one device request at most (1 MiB).
const READ_RUN_BLOCKS_MAX: usize = 256;
/// Attempts to read a block whose content does not match its checksum (reuse races).
const READ_ATTEMPTS: usize = 2;

/// Everything protected by the state lock.
pub(crate) struct State {
    pub(crate) map: BlockMap,
    pub(crate) rc: Refcounts,
    pub(crate) alloc: Allocator,
    pub(crate) journal: Journal,
    pub(crate) packer: Packer,
    pub(crate) index: Index,
    /// Per-block reuse stamps (hash verification mode only).
    pub(crate) stamps: Option<Vec<u16>>,
    /// Bumped whenever freed blocks become reusable; a verification done before a bump is stale.
    pub(crate) reuse_gen: u64,
    pub(crate) counters: Counters,
    pub(crate) red: ReductionCounters,
    /// Data blocks placed but not yet written: merged into large writes when the buffer
    /// fills or before a commit syncs data. They are the authority for their pbns.
    pub(crate) staged: Vec<(u64, Block)>,
    /// Staged batches being written outside the state lock, by ticket, oldest first. They
    /// stay the authority for their pbns until pruned after their write completes; a pbn
    /// found in several batches is answered by the newest.
    pub(crate) writing: Vec<(u64, Vec<(u64, Block)>)>,
}

impl State {
    /// True when `loc`'s reuse stamp is its block's current one (always, without stamps):
    /// the block has not been freed since the index entry was made.
    fn stamp_matches(&self, loc: &Location) -> bool {
        self.stamps.as_ref().is_none_or(|s| s.get(loc.pbn as usize) == Some(&loc.stamp))
    }
}

/// An open volume. Share it between threads with `Arc`; every method takes `&self`.
pub struct Volume {
    pub(crate) data: Dev,
    pub(crate) meta: Dev,
    pub(crate) geo: Geometry,
    pub(crate) sb: Mutex<Superblock>,
    pub(crate) state: Mutex<State>,
    commit_lock: Mutex<()>,
    /// Tickets of data writes in flight outside the state lock. A commit waits for every
    /// ticket issued before it took its journal batch, so the data sync covers them.
    tickets: Arc<Tickets>,
    /// Writes full staging batches in the background (None: read-only, or inline writes).
    writer: Option<DataWriter>,
    cache: Mutex<ContentCache>,
    rmw: Vec<Mutex<()>>,
    io: Arc<IoCounters>,
    policy: WritePolicy,
    dedup: bool,
    compression: Compression,
    /// Newly written blocks enter the content cache (see `OpenOptions::cache_writes`).
    cache_writes: bool,
    pub(crate) read_only: bool,
    health: Arc<Health>,
    /// Set under the state lock whenever entries are appended or a batch is taken: the
    /// pending journal entries have reached the point where a writer should commit. Lets
    /// `after_write` decide without taking the state lock again.
    journal_pressure: AtomicBool,
    /// Problems noticed while opening (superblock copies), for `check`; entries starting
    /// with "note: " are informational (torn writes a crash left behind).
    pub(crate) open_notes: Vec<String>,
    /// Lifetime counters as loaded at open (this open counted): this process's counters
    /// are added to these, never to a figure that already includes them.
    lifetime_base: LifetimeCounters,
}

/// How one chunk of a write will be stored.
enum Plan {
    Zero,
    Data {
        hash: [u8; 32],
        crc: u32,
        candidate: Option<Location>,
        verified: bool,
        frag: Option<Vec<u8>>,
        /// The block's own copy when it will be stored raw, made outside the state lock.
        raw: Option<Block>,
    },
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
    u.copy_from_slice(&h.finalize().as_bytes()[..16]);
    u
}

fn uuid_lo(u: &[u8; 16]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&u[..8]);
    u64::from_le_bytes(b)
}

/// Formats a UUID as hex.
pub fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

impl Volume {
    // ----------------------------------------------------------------------------------
    // format / open / close
    // ----------------------------------------------------------------------------------

    /// Formats `data` (and `meta`, when given) as a new, empty volume. Refuses to overwrite
    /// an existing volume unless `force`.
    pub fn format(
        data: Arc<dyn Storage>,
        meta: Option<Arc<dyn Storage>>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        Self::format_with_hint(data, meta, opts, force, None)
    }

    fn format_with_hint(
        data: Arc<dyn Storage>,
        meta: Option<Arc<dyn Storage>>,
        opts: &FormatOptions,
        force: bool,
        meta_path: Option<String>,
    ) -> Result<()> {
        opts.validate()?;
        if let Some(machine) = crate::io::hugemem::physical_memory_bytes().filter(|&m| opts.index_memory_bytes > m) {
            // A volume whose index cannot be allocated here could never be opened here.
            return Err(Error::InvalidArgument(format!(
                "index memory {} exceeds this machine's {machine} bytes of memory",
                opts.index_memory_bytes
            )));
        }
        let io = Arc::new(IoCounters::default());
        let data = Dev::new(data, io.clone());
        let meta = meta.map(|m| Dev::new(m, io));
        if !force {
            for (dev, role) in std::iter::once((&data, 0u8)).chain(meta.iter().map(|m| (m, 1u8))) {
                if dev.len() >= 2 * BLOCK_SIZE_U64 {
                    match Superblock::read(dev, role) {
                        Err(Error::NotAVolume(m)) if !m.contains("role") => {}
                        Err(e @ Error::Io { .. }) => return Err(e),
                        _ => return Err(Error::AlreadyFormatted(dev.name())),
                    }
                }
            }
        }
        let geo = Geometry::compute(
            opts.logical_size_bytes / BLOCK_SIZE_U64,
            data.len(),
            meta.as_ref().map(|m| m.len()),
            opts.slab_size_bytes / BLOCK_SIZE_U64,
            opts.journal_size_bytes,
            opts.index_memory_bytes,
        )?;
        let sb = Superblock {
            uuid: new_uuid(),
            generation: 1,
            compression: opts.compression,
            dedup: opts.dedup,
            verify: opts.verify,
            write_policy: opts.write_policy,
            clean: true,
            geometry: geo,
            index_memory_bytes: opts.index_memory_bytes,
            next_entry_seq: 1,
            next_block_seq: 0,
            mapped_blocks: 0,
            zero_blocks: 0,
            index_saved_entries: 0,
            meta_path,
            lifetime: LifetimeCounters::default(),
        };
        // Metadata device first: a crash mid-format leaves the data device unformatted.
        if let Some(m) = &meta {
            write_copies(m, &sb, 1)?;
        }
        write_copies(&data, &sb, 0)?;
        Ok(())
    }

    /// Formats a file or block device by path; `physical_size` creates or extends a file.
    pub fn format_path(
        path: &Path,
        physical_size: Option<u64>,
        meta_device: Option<&Path>,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<()> {
        let data: Arc<dyn Storage> = Arc::new(FileStorage::create(path, physical_size)?);
        let meta: Option<Arc<dyn Storage>> = match meta_device {
            Some(m) => Some(Arc::new(FileStorage::open(m, false)?)),
            None => None,
        };
        let hint = meta_device.and_then(|m| std::fs::canonicalize(m).ok()).map(|p| p.display().to_string());
        Self::format_with_hint(data, meta, opts, force, hint)
    }

    /// Opens a volume by path. A volume formatted with a metadata device remembers its path;
    /// `meta_device` overrides it.
    pub fn open_path(path: &Path, meta_device: Option<&Path>, opts: &OpenOptions) -> Result<Volume> {
        let file = Arc::new(FileStorage::open_with(path, opts.read_only, opts.io_mode)?);
        let sb = {
            let dev = Dev::new(file.clone(), Arc::new(IoCounters::default()));
            Superblock::read(&dev, 0)?.0
        };
        // `auto` resolves from the volume: byte verification reads every candidate, and the
        // page cache serves those reads from RAM; hash verification reads nothing.
        let mode = opts.io_mode.for_verify(sb.verify == DedupVerify::Hash);
        let file = Arc::try_unwrap(file).map_err(|_| Error::InvalidArgument("device still shared".into()))?;
        let data: Arc<dyn Storage> =
            Arc::new(if mode == crate::io::IoMode::Buffered { file.into_buffered() } else { file });
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
            Some(m) => Some(Arc::new(FileStorage::open_with(&m, opts.read_only, mode)?)),
            None => None,
        };
        Self::open(data, meta, opts)
    }

    /// Opens a volume, replaying the journal if it was not closed cleanly.
    pub fn open(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Volume> {
        let io = Arc::new(IoCounters::default());
        let data = Dev::new(data, io.clone());
        let (mut sb, mut notes) = Superblock::read(&data, 0)?;
        let geo = sb.geometry;
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
                notes.extend(mnotes);
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
        if data.len() < geo.data_dev_blocks * BLOCK_SIZE_U64
            || (separate && meta.len() < geo.meta_dev_blocks * BLOCK_SIZE_U64)
        {
            return Err(Error::Corrupt(format!(
                "device {} is smaller than the volume's recorded geometry (was it truncated?)",
                data.name()
            )));
        }
        let ulo = uuid_lo(&sb.uuid);
        let was_clean = sb.clean;
        // Allocated before anything is written: an index this machine cannot hold is a
        // clear error that leaves the volume exactly as it was (still clean, its saved
        // index still valid), and `index_memory_bytes` can lower it.
        let full_hash = sb.verify == DedupVerify::Hash;
        let index = Index::try_with_prefault(
            opts.index_memory_bytes.unwrap_or(sb.index_memory_bytes),
            full_hash,
            !opts.read_only,
        )?;
        let mut rc = Refcounts::load(geo, ulo, meta.clone())?;
        let mut map = BlockMap::new(geo, ulo, meta.clone(), opts.block_map_cache_bytes);
        let replay = journal::scan(&meta, &geo, &sb.uuid)?;
        for (seq, e) in &replay.entries {
            let seq = *seq;
            if seq > map.page_seq(e.lba)? {
                map.set(e.lba, e.new, seq)?;
            }
            let apply_new = e.new.is_data() && seq > rc.page_seq(e.new.pbn);
            let apply_old = e.old.is_data() && seq > rc.page_seq(e.old.pbn);
            if apply_new {
                rc.inc(&e.new, seq).map_err(|err| Error::Corrupt(format!("journal replay of entry {seq}: {err}")))?;
            }
            if apply_old {
                rc.dec(&e.old, seq).map_err(|err| Error::Corrupt(format!("journal replay of entry {seq}: {err}")))?;
            }
        }
        // After a clean close the superblock's counters are authoritative (repair may have
        // corrected them after the last journal block was written).
        let counters = match replay.counters {
            Some(c) if !sb.clean => c,
            _ => Counters { mapped_blocks: sb.mapped_blocks, zero_blocks: sb.zero_blocks },
        };
        let next_entry_seq = (replay.max_entry_seq + 1).max(sb.next_entry_seq).max(rc.max_seq() + 1);
        let next_block_seq = replay.max_block_seq.map_or(0, |m| m + 1).max(sb.next_block_seq);
        let mut journal = Journal::new(geo, sb.uuid, next_entry_seq, next_block_seq, counters);
        if replay.damaged_blocks > 0 {
            notes.push(format!(
                "note: {} journal blocks outside the replayed run failed their checksum (writes torn by a crash; harmless)",
                replay.damaged_blocks
            ));
        }
        if !opts.read_only {
            // Make the replayed state durable in the pages, so the journal can restart empty
            // with block sequences above every stale block still on disk.
            map.write_dirty(u64::MAX)?;
            rc.write_dirty(u64::MAX)?;
            meta.sync()?;
            map.note_synced();
            rc.note_synced();
            journal.head_block_seq = journal.next_block_seq;
            sb.clean = false;
            sb.lifetime.read_write_opens += 1;
            sb.lifetime.recoveries += u64::from(!was_clean);
            write_superblock(&data, separate.then_some(&meta), &mut sb)?;
        }
        if map.damaged_pages > 0 || rc.damaged_pages > 0 {
            notes.push(format!(
                "note: {} block map and {} refcount pages had a damaged copy and no valid one (a first write torn by a crash, rebuilt from the journal; if not, the reference and checksum audit reports the damage)",
                map.damaged_pages, rc.damaged_pages
            ));
        }
        let alloc = Allocator::from_counts(rc.counts(), geo.slab_blocks);
        let state = State {
            map,
            alloc,
            journal,
            packer: Packer::new(sb.compression),
            index,
            stamps: full_hash.then(|| crate::io::hugemem::zeroed(geo.data_blocks as usize)),
            reuse_gen: 0,
            counters,
            red: ReductionCounters::default(),
            staged: Vec::new(),
            writing: Vec::new(),
            rc,
        };
        // The saved index is from the last clean close. With byte verification a stale
        // entry is harmless (it fails verification), so it is used after a crash too; with
        // hash verification only a clean volume's index is trusted.
        let mut state = state;
        let saved = if was_clean || !full_hash { sb.index_saved_entries } else { 0 };
        if saved > 0 && sb.dedup {
            match load_index(&meta, &geo, ulo, saved, state.index.bytes_per_entry()) {
                Ok(bytes) => {
                    state.index.import(&bytes);
                }
                Err(e) => notes.push(format!("note: saved fingerprint index ignored (it is advisory): {e}")),
            }
        }
        let policy = opts.write_policy.unwrap_or(sb.write_policy);
        let tickets = Arc::new(Tickets::default());
        let health = Arc::new(Health::default());
        let writer = (!opts.read_only && opts.background_writes)
            .then(|| DataWriter::start(data.clone(), geo, tickets.clone(), health.clone()))
            .flatten();
        let (dedup, compression) = (sb.dedup, sb.compression);
        let cache_writes = opts.writes_cached(sb.verify);
        let lifetime_base = sb.lifetime;
        Ok(Volume {
            data,
            meta,
            geo,
            sb: Mutex::new(sb),
            state: Mutex::new(state),
            commit_lock: Mutex::new(()),
            tickets,
            writer,
            cache: Mutex::new(ContentCache::new(opts.content_cache_bytes)),
            rmw: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            io,
            policy,
            dedup,
            compression,
            cache_writes,
            read_only: opts.read_only,
            health,
            journal_pressure: AtomicBool::new(false),
            open_notes: notes,
            lifetime_base,
        })
    }

    /// Makes everything durable, writes all metadata and marks the volume clean.
    pub fn close(self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_not_failed()?;
        let _c = self.commit_lock.lock();
        let mut st = self.state.lock();
        self.checkpoint(&mut st)?;
        let saved = self.save_index(&st)?;
        let mut sb = self.sb.lock();
        sb.clean = true;
        sb.index_saved_entries = saved;
        sb.next_entry_seq = st.journal.next_entry_seq;
        sb.next_block_seq = st.journal.next_block_seq;
        sb.mapped_blocks = st.counters.mapped_blocks;
        sb.zero_blocks = st.counters.zero_blocks;
        sb.lifetime = self.lifetime_now(&st);
        write_superblock(&self.data, self.separate_meta(), &mut sb)
    }

    // ----------------------------------------------------------------------------------
    // helpers
    // ----------------------------------------------------------------------------------

    /// Waits for the work an open starts in the background (populating the fingerprint
    /// index's memory) to finish. Nothing needs it for correctness; a benchmark calls it
    /// so that its clock measures steady-state writes rather than first-touch page faults.
    pub fn wait_ready(&self) {
        self.state.lock().index.wait_prefault();
    }

    /// True when the data device is read and written with direct I/O (no page cache).
    pub fn direct_io(&self) -> bool {
        self.data.is_direct()
    }

    /// Logical size in bytes.
    pub fn logical_size(&self) -> u64 {
        self.geo.logical_blocks * BLOCK_SIZE_U64
    }

    /// The write policy in effect.
    pub fn write_policy(&self) -> WritePolicy {
        self.policy
    }

    /// The metadata device path recorded at format, if any.
    pub fn meta_path(&self) -> Option<String> {
        self.sb.lock().meta_path.clone()
    }

    /// The volume's geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.logical_size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange { offset, len, size }),
        }
    }

    fn check_not_failed(&self) -> Result<()> {
        self.health.check()
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        self.check_not_failed()
    }

    /// Marks the volume failed after an error that may have left device state unknown.
    fn fail<T>(&self, e: Error) -> Result<T> {
        self.health.fail(&e);
        Err(e)
    }

    fn guard<T>(&self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => self.fail(e),
        }
    }

    // ----------------------------------------------------------------------------------
    // commit and checkpoint
    // ----------------------------------------------------------------------------------

    /// Seals the packer, writes the staged data and encodes pending journal entries (state
    /// lock held). Returns the batch and the first ticket its data sync need not wait for:
    /// every entry in the batch refers to data written already, written here, or in a
    /// write with an earlier ticket.
    fn take_commit(&self, st: &mut State) -> Result<(CommitBatch, u64)> {
        self.seal_packer(st)?;
        let staged = std::mem::take(&mut st.staged);
        write_merged(&self.data, &self.geo, staged, false)?;
        self.tickets.retain_active(&mut st.writing);
        let ticket = self.tickets.next();
        let batch = st.journal.take_batch()?;
        self.note_pressure(st);
        Ok((batch, ticket))
    }

    /// Records whether pending journal entries call for a commit (state lock held).
    fn note_pressure(&self, st: &State) {
        let full = st.journal.pending_len() >= st.journal.pending_entries_max();
        self.journal_pressure.store(full, Ordering::Release);
    }

    /// Waits for the data writes in flight outside the state lock with a ticket below
    /// `ticket`, then syncs data, writes the journal blocks and syncs them. Needs no state
    /// lock (and may hold it: finishing writers never take it).
    fn write_commit(&self, batch: &CommitBatch, ticket: u64) -> Result<()> {
        if batch.blocks.is_empty() {
            return Ok(());
        }
        self.tickets.wait_below(ticket);
        // A failed in-flight write leaves the device state unknown: no journal for it.
        self.check_not_failed()?;
        self.data.sync()?;
        journal::write_batch(&self.meta, batch)?;
        self.meta.sync()
    }

    /// Publishes a written batch as durable (state lock held).
    fn finish_commit(&self, st: &mut State, batch: &CommitBatch) {
        if batch.blocks.is_empty() {
            return;
        }
        st.journal.durable_seq = st.journal.durable_seq.max(batch.last_seq);
        // The commit waited for every data write issued before it: forget those batches
        // now, before blocks are released below, so no completed batch can answer for a
        // block after it is reused (and reads after a flush see the device).
        self.tickets.retain_active(&mut st.writing);
        st.map.note_synced();
        st.rc.note_synced();
        let rc = &st.rc;
        if st.alloc.release_durable(batch.last_seq, |pbn| rc.get(pbn) == 0) > 0 {
            st.reuse_gen += 1;
        }
        st.red.commits += 1;
    }

    /// Makes every journal entry up to `target` durable (group commit: concurrent callers
    /// queue on the commit lock and find their entries already durable).
    fn commit_to(&self, target: u64) -> Result<()> {
        let _c = self.commit_lock.lock();
        self.check_not_failed()?;
        let batch = {
            let mut st = self.state.lock();
            if st.journal.durable_seq >= target && !st.packer.has_fragments() {
                return Ok(());
            }
            let r = self.take_commit(&mut st);
            self.guard(r)?
        };
        let (batch, ticket) = batch;
        let r = self.write_commit(&batch, ticket);
        self.guard(r)?;
        let mut st = self.state.lock();
        self.finish_commit(&mut st, &batch);
        if st.journal.wants_checkpoint() {
            let r = self.checkpoint(&mut st).and_then(|()| self.persist_lifetime(&st));
            self.guard(r)?;
        }
        let durable = st.journal.durable_seq;
        let r = st.map.evict(durable);
        self.guard(r)
    }

    /// Commits everything, writes every dirty page, syncs, and reclaims journal space.
    /// Caller holds the commit lock and the state lock.
    fn checkpoint(&self, st: &mut State) -> Result<()> {
        let (batch, ticket) = self.take_commit(st)?;
        self.write_commit(&batch, ticket)?;
        self.finish_commit(st, &batch);
        let durable = st.journal.durable_seq;
        st.map.write_dirty(durable)?;
        st.rc.write_dirty(durable)?;
        self.meta.sync()?;
        st.map.note_synced();
        st.rc.note_synced();
        st.journal.head_block_seq = st.journal.next_block_seq;
        st.red.checkpoints += 1;
        Ok(())
    }

    /// Makes every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_not_failed()?;
        let target = self.state.lock().journal.next_entry_seq.saturating_sub(1);
        self.commit_to(target)
    }

    // ----------------------------------------------------------------------------------
    // write path
    // ----------------------------------------------------------------------------------

    /// Writes `data` at byte `offset`. With `fua` (or the sync policy) the write is durable
    /// when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        let mut last_seq = 0u64;
        for seg in segments(offset, data.len() as u64, WRITE_BLOCKS_PER_BATCH) {
            let src = data.get(seg.pos as usize..(seg.pos + seg.len) as usize).unwrap_or(&[]);
            let seq = if seg.whole { self.write_blocks(seg.lba, src)? } else { self.rmw(seg.lba, seg.within, src)? };
            last_seq = last_seq.max(seq);
        }
        self.after_write(fua, last_seq)
    }

    fn after_write(&self, fua: bool, last_seq: u64) -> Result<()> {
        let must = fua || self.policy == WritePolicy::Sync;
        let pressure = self.journal_pressure.load(Ordering::Acquire);
        if must {
            // A FUA write must also cover an earlier identical write it was found equal to,
            // so commit everything pending rather than only this request's entries.
            let target = self.state.lock().journal.next_entry_seq.saturating_sub(1).max(last_seq);
            self.commit_to(target)
        } else if pressure {
            let target = self.state.lock().journal.next_entry_seq.saturating_sub(1);
            self.commit_to(target)
        } else {
            Ok(())
        }
    }

    /// Read-modify-write of part of one block.
    fn rmw(&self, lba: u64, within: usize, piece: &[u8]) -> Result<u64> {
        let stripe = self.rmw.get(lba as usize % RMW_STRIPES).ok_or_else(|| Error::InvalidArgument("stripe".into()))?;
        let _g = stripe.lock();
        let mut block = vec![0u8; BLOCK_SIZE];
        self.read_blocks(lba, 1, &mut block)?;
        block
            .get_mut(within..within + piece.len())
            .ok_or_else(|| Error::InvalidArgument("range".into()))?
            .copy_from_slice(piece);
        self.write_blocks(lba, &block)
    }

    /// Writes whole blocks starting at `lba`; returns the last journal sequence used.
    /// When the volume is full but freed blocks await a commit, commits and retries once
    /// (blocks already applied are rewritten with the same content, which is a no-op).
    fn write_blocks(&self, lba0: u64, buf: &[u8]) -> Result<u64> {
        match self.write_blocks_once(lba0, buf) {
            Err(Error::NoSpace(_)) if self.state.lock().alloc.pending_len() > 0 => {
                self.flush()?;
                self.write_blocks_once(lba0, buf)
            }
            r => r,
        }
    }

    fn write_blocks_once(&self, lba0: u64, buf: &[u8]) -> Result<u64> {
        let n = buf.len() / BLOCK_SIZE;
        let sb_dedup = self.dedup;
        let compression = self.compression;
        // Phase 1: fingerprints (no lock; large requests use every core).
        let mut plans: Vec<Plan> = Vec::with_capacity(n);
        plans.resize_with(n, || Plan::Zero);
        par_for_each(&mut plans, |i, p| {
            let c = buf.get(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE).unwrap_or(&[]);
            if !crate::codec::is_zero(c) {
                *p = Plan::Data {
                    hash: if sb_dedup { *blake3::hash(c).as_bytes() } else { [0u8; 32] },
                    crc: crc32c::crc32c(c),
                    candidate: None,
                    verified: false,
                    frag: None,
                    raw: None,
                };
            }
        });
        // Phase 2: index lookups (state lock).
        let gen_at_lookup;
        let hash_mode;
        {
            let st = self.state.lock();
            gen_at_lookup = st.reuse_gen;
            hash_mode = st.stamps.is_some();
            if sb_dedup {
                for (i, p) in plans.iter_mut().enumerate() {
                    if let Plan::Data { hash, candidate, verified, .. } = p {
                        // Only a block in use now can be a candidate: a free block could be
                        // reallocated before phase 4 without any reuse-generation bump. With
                        // hash verification its reuse stamp must match too (placement checks
                        // again; a stale candidate found here is compressed outside the lock).
                        let live = |l: &Location| st.rc.get(l.pbn) > 0 && st.stamp_matches(l);
                        if let Some(loc) = st.index.lookup(hash).filter(live) {
                            *candidate = Some(loc);
                            if hash_mode {
                                *verified = true;
                            } else {
                                // A block not on the device yet (the device may still hold its
                                // previous life) is decided here, from memory.
                                let chunk = buf.get(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE).unwrap_or(&[]);
                                let mut out = [0u8; BLOCK_SIZE];
                                let e = MapEntry { pbn: loc.pbn, state: loc.state, crc: 0 };
                                if let Some(ok) = decode_unwritten(&st, &e, &mut out) {
                                    *verified = ok && out == chunk;
                                    if !*verified {
                                        *candidate = None;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Phase 3: verify candidates and compress the rest (no lock; parallel).
        par_for_each(&mut plans, |i, p| {
            let chunk = buf.get(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE).unwrap_or(&[]);
            if let Plan::Data { candidate, verified, frag, raw, .. } = p {
                if let (Some(loc), false, false) = (*candidate, *verified, hash_mode) {
                    *verified = self.verify_candidate(loc, chunk);
                }
                if !*verified {
                    *frag = packer::compress(compression, chunk);
                    if frag.is_none() {
                        *raw = Some(Block::from(chunk));
                    }
                }
            }
        });
        // Phase 4: place, write and journal (state lock).
        let mut st = self.state.lock();
        let r = self.apply_plans(&mut st, lba0, n, buf, &mut plans, gen_at_lookup, compression);
        match r {
            Ok(seq) => {
                self.note_pressure(&st);
                let durable = st.journal.durable_seq;
                let r = st.map.evict(durable);
                self.guard(r)?;
                // A full staging buffer is written after the lock is let go: by the
                // data-writer thread (this writer goes on hashing and compressing), else here.
                let pending = (st.staged.len() >= STAGED_BLOCKS_MAX).then(|| self.begin_write(&mut st));
                drop(st);
                if let Some((ticket, blocks)) = pending {
                    let queued = match &self.writer {
                        Some(w) => w.submit(ticket, blocks),
                        None => Err((ticket, blocks)),
                    };
                    match queued {
                        Ok(()) => self.check_not_failed()?,
                        Err((ticket, blocks)) => self.finish_write(ticket, blocks)?,
                    }
                }
                Ok(seq)
            }
            // A device error while placing leaves the device state unknown: the volume is
            // failed. Every other error is found before the chunk changes anything (see
            // `apply_entry`), so it fails this request only, never the volume.
            Err(e @ Error::Io { .. }) => self.fail(e),
            Err(e) => Err(e),
        }
    }

    /// Reads the candidate's content (cache first, else a verification read) and compares.
    fn verify_candidate(&self, loc: Location, chunk: &[u8]) -> bool {
        if loc.pbn >= self.geo.data_blocks {
            return false;
        }
        let cached = self.cache.lock().get(loc.pbn);
        let block = match cached {
            Some(b) => b,
            None => {
                let mut b = new_block();
                let Some(buf) = Arc::get_mut(&mut b) else { return false };
                if self.data.read(IoKind::Verify, buf, self.geo.data_offset(loc.pbn)).is_err() {
                    return false;
                }
                self.cache.lock().fill(loc.pbn, b.clone());
                b
            }
        };
        content_matches(&block, loc.state, chunk)
    }

    fn alloc_block(&self, st: &mut State) -> Result<u64> {
        if let Some(p) = st.alloc.alloc() {
            // The cache may still hold the block's previous content; an index entry for
            // that content must not verify against it while the block is being refilled.
            self.cache.lock().remove(p);
            return Ok(p);
        }
        Err(Error::NoSpace(format!(
            "all {} data blocks are in use ({} await a flush to be reused)",
            self.geo.data_blocks,
            st.alloc.pending_len()
        )))
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_plans(
        &self,
        st: &mut State,
        lba0: u64,
        n: usize,
        buf: &[u8],
        plans: &mut [Plan],
        gen_at_lookup: u64,
        compression: Compression,
    ) -> Result<u64> {
        // Load every page first, so a read error changes nothing.
        for i in 0..n as u64 {
            st.map.get(lba0 + i).map_err(|e| match e {
                Error::Io { .. } | Error::Corrupt(_) => e,
                other => other,
            })?;
        }
        let hash_mode = st.stamps.is_some();
        let stale = st.reuse_gen != gen_at_lookup;
        let mut last = st.journal.next_entry_seq.saturating_sub(1);
        let mut placed = Ok(());
        for (i, p) in plans.iter_mut().enumerate() {
            let chunk = buf.get(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE).unwrap_or(&[]);
            let e = match self.place(st, p, chunk, stale, hash_mode, compression) {
                Ok(e) => e,
                Err(err) => {
                    placed = Err(err);
                    break;
                }
            };
            match self.apply_entry(st, lba0 + i as u64, e) {
                Ok(s) => last = s.unwrap_or(last),
                Err(err) => {
                    placed = Err(err);
                    break;
                }
            }
            st.red.blocks_written += 1;
        }
        placed.map(|()| last)
    }

    /// Decides where one chunk goes: a verified duplicate, the packer, or a new raw block.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        st: &mut State,
        p: &mut Plan,
        chunk: &[u8],
        stale: bool,
        hash_mode: bool,
        compression: Compression,
    ) -> Result<MapEntry> {
        let Plan::Data { hash, crc, candidate, verified, frag, raw } = p else {
            st.red.zero_blocks += 1;
            return Ok(MapEntry::ZERO);
        };
        let mut chosen = None;
        // Re-check the verified candidate: still referenced, below the cap, and not
        // freed-and-reused since it was verified.
        if let (Some(loc), true) = (*candidate, *verified) {
            let c = st.rc.get(loc.pbn);
            if c > 0 && c < REFCOUNT_MAX && st.stamp_matches(&loc) && (!stale || hash_mode) {
                chosen = Some(loc);
            } else if c >= REFCOUNT_MAX {
                st.red.refcount_cap_copies += 1;
            }
        } else if let Some(loc) = *candidate {
            st.red.dedup_verify_failures += 1;
            st.index.remove(hash, loc);
        }
        if chosen.is_none() && self.dedup {
            // A duplicate stored by this request or a concurrent writer since the lookup:
            // only taken when it can be verified from memory.
            if let Some(loc) = st.index.lookup(hash).filter(|l| Some(*l) != *candidate) {
                let c = st.rc.get(loc.pbn);
                if c > 0 && c < REFCOUNT_MAX {
                    let ok = if hash_mode {
                        st.stamp_matches(&loc)
                    } else if let Some(ok) = {
                        let e = MapEntry { pbn: loc.pbn, state: loc.state, crc: 0 };
                        let mut out = [0u8; BLOCK_SIZE];
                        decode_unwritten(st, &e, &mut out).map(|ok| ok && out == chunk)
                    } {
                        ok
                    } else {
                        let cached = self.cache.lock().get(loc.pbn);
                        cached.is_some_and(|b| content_matches(&b, loc.state, chunk))
                    };
                    if ok {
                        chosen = Some(loc);
                    }
                }
            }
        }
        if let Some(loc) = chosen {
            st.red.dedup_hits += 1;
            return Ok(MapEntry { pbn: loc.pbn, state: loc.state, crc: *crc });
        }
        if frag.is_none() && compression != Compression::None && *verified {
            *frag = packer::compress(compression, chunk);
        }
        let e = match frag.as_deref() {
            Some(f) => {
                // A block whose slots already carry REFCOUNT_MAX references cannot take the
                // new fragment's reference (this copy exists *because* the cap was reached).
                let rc = &st.rc;
                let below_cap = |pbn: u64| rc.get(pbn) < REFCOUNT_MAX;
                let (pbn, slot) = match st.packer.try_add(f, below_cap) {
                    Some(placed) => placed,
                    None => {
                        if !st.packer.can_open() {
                            if let Some((pbn, block, _)) = st.packer.seal_oldest() {
                                self.stage(st, pbn, Block::from(block))?;
                                st.red.packed_blocks_written += 1;
                            }
                        }
                        let pbn = self.alloc_block(st)?;
                        st.packer.open(pbn);
                        st.packer
                            .try_add(f, |p| p == pbn)
                            .ok_or_else(|| Error::Corrupt("fragment does not fit an empty block".into()))?
                    }
                };
                st.red.compressed_blocks += 1;
                MapEntry::packed(pbn, slot, *crc)
            }
            None => {
                let pbn = self.alloc_block(st)?;
                let block = raw.take().unwrap_or_else(|| Block::from(chunk));
                self.stage(st, pbn, block)?;
                st.red.raw_blocks += 1;
                MapEntry::raw(pbn, *crc)
            }
        };
        if self.dedup {
            let stamp = st.stamps.as_ref().and_then(|s| s.get(e.pbn as usize).copied()).unwrap_or(0);
            st.index.insert(hash, Location { pbn: e.pbn, state: e.state, stamp });
        }
        Ok(e)
    }

    /// Writes every open packed block that holds fragments.
    fn seal_packer(&self, st: &mut State) -> Result<()> {
        for (pbn, block, count) in st.packer.seal_all() {
            if count == 0 {
                st.alloc.unreserve(pbn);
            } else {
                self.stage(st, pbn, Block::from(block))?;
                st.red.packed_blocks_written += 1;
            }
        }
        Ok(())
    }

    /// Queues a placed data block for writing (and caches it when writes are cached). The
    /// writer that fills the buffer writes it outside the lock; a buffer past its hard
    /// bound (one huge request) is written here.
    fn stage(&self, st: &mut State, pbn: u64, block: Block) -> Result<()> {
        if self.cache_writes {
            self.cache.lock().put(pbn, block.clone());
        }
        st.staged.push((pbn, block));
        if st.staged.len() >= STAGED_BLOCKS_HARD_MAX {
            let staged = std::mem::take(&mut st.staged);
            write_merged(&self.data, &self.geo, staged, false)?;
        }
        Ok(())
    }

    /// Moves the staged blocks to `writing` under a new ticket (state lock held), and
    /// forgets batches whose writes have completed.
    fn begin_write(&self, st: &mut State) -> (u64, Vec<(u64, Block)>) {
        let blocks = std::mem::take(&mut st.staged);
        self.tickets.retain_active(&mut st.writing);
        let ticket = self.tickets.issue();
        st.writing.push((ticket, blocks.clone()));
        (ticket, blocks)
    }

    /// Writes a batch from `begin_write` here (no lock held) and retires its ticket,
    /// failed or not.
    fn finish_write(&self, ticket: u64, blocks: Vec<(u64, Block)>) -> Result<()> {
        write_ticketed(&self.data, &self.geo, blocks, &[ticket], &self.tickets, &self.health)
    }

    /// Journals and applies one mapping change; None when it changes nothing.
    fn apply_entry(&self, st: &mut State, lba: u64, new: MapEntry) -> Result<Option<u64>> {
        let old = st.map.get(lba)?;
        if old == new {
            return Ok(None);
        }
        // Checked before anything changes: a refused reference leaves map, counts and
        // journal as they were, so the request fails alone (the volume stays healthy).
        if new.is_data() {
            st.rc.check_inc(&new)?;
        }
        if old.is_data() {
            st.rc.check_dec(&old)?;
        }
        let seq = st.journal.append(lba, new, old);
        st.map.set(lba, new, seq)?;
        if new.is_data() {
            st.rc.inc(&new, seq)?;
        }
        if old.is_data() && st.rc.dec(&old, seq)? {
            st.alloc.free_later(old.pbn, seq);
            // Nothing can read a block without references: its cached copy only takes
            // room from live blocks (under overwrites, the cache would fill with them).
            self.cache.lock().remove(old.pbn);
            let wrapped = st.stamps.as_mut().and_then(|s| s.get_mut(old.pbn as usize)).is_some_and(|s| {
                *s = s.wrapping_add(1);
                *s == 0
            });
            if wrapped {
                // A stale entry made 65536 reuses ago would match the stamp again.
                st.index.remove_pbn(old.pbn);
                st.red.stamp_wrap_scans += 1;
            }
        }
        st.counters.apply(&old, &new);
        Ok(Some(seq))
    }

    // ----------------------------------------------------------------------------------
    // discard / write zeroes
    // ----------------------------------------------------------------------------------

    /// Discards a byte range: it reads back as zeros and its space is freed.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, MapEntry::UNMAPPED, false)
    }

    /// Writes zeros to a byte range without data I/O (space is freed).
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.unmap(offset, len, MapEntry::ZERO, fua)
    }

    fn unmap(&self, offset: u64, len: u64, to: MapEntry, fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        let mut last_seq = 0;
        for seg in segments(offset, len, UNMAP_BLOCKS_PER_LOCK) {
            if !seg.whole {
                let zeros = vec![0u8; seg.len as usize];
                last_seq = last_seq.max(self.rmw(seg.lba, seg.within, &zeros)?);
                continue;
            }
            {
                let mut st = self.state.lock();
                for i in 0..seg.len / BLOCK_SIZE_U64 {
                    match self.apply_entry(&mut st, seg.lba + i, to) {
                        Ok(s) => last_seq = last_seq.max(s.unwrap_or(0)),
                        // Nothing changed yet: a read error loading the first page is clean.
                        Err(e @ Error::Io { .. }) if i == 0 => return Err(e),
                        Err(e) => return self.fail(e),
                    }
                }
                self.note_pressure(&st);
                let durable = st.journal.durable_seq;
                let r = st.map.evict(durable);
                self.guard(r)?;
            }
            self.after_write(false, last_seq)?;
        }
        self.after_write(fua, last_seq)
    }

    // ----------------------------------------------------------------------------------
    // read path
    // ----------------------------------------------------------------------------------

    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        // Whole-block runs are bounded so one huge read does not pin the block map cache.
        for seg in segments(offset, buf.len() as u64, READ_BLOCKS_PER_CALL) {
            let dst = buf
                .get_mut(seg.pos as usize..(seg.pos + seg.len) as usize)
                .ok_or_else(|| Error::InvalidArgument("range".into()))?;
            if seg.whole {
                self.read_blocks(seg.lba, dst.len() / BLOCK_SIZE, dst)?;
            } else {
                let mut block = vec![0u8; BLOCK_SIZE];
                self.read_blocks(seg.lba, 1, &mut block)?;
                dst.copy_from_slice(block.get(seg.within..seg.within + dst.len()).unwrap_or(&[]));
            }
        }
        Ok(())
    }

    /// Reads whole blocks into `out` (len = n * 4096).
    fn read_blocks(&self, lba0: u64, n: usize, out: &mut [u8]) -> Result<()> {
        let mut attempts = vec![0usize; n];
        let mut todo: Vec<usize> = (0..n).collect();
        while !todo.is_empty() {
            // Mappings, and fragments still in the open packed block, under the lock.
            let mut lookups: Vec<(usize, MapEntry, bool)> = Vec::with_capacity(todo.len());
            {
                let mut st = self.state.lock();
                for &i in &todo {
                    let e = st.map.get(lba0 + i as u64)?;
                    let mut done = false;
                    if e.is_data() {
                        let dst = out.get_mut(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE).unwrap_or(&mut []);
                        if let Some(ok) = decode_unwritten(&st, &e, dst) {
                            if !ok || crc32c::crc32c(dst) != e.crc {
                                return Err(Error::Corrupt(format!(
                                    "logical block {}: unwritten data does not match its checksum",
                                    lba0 + i as u64
                                )));
                            }
                            done = true;
                        }
                    }
                    lookups.push((i, e, done));
                }
                let durable = st.journal.durable_seq;
                st.map.evict(durable)?;
            }
            let mut retry = Vec::new();
            // Through the content cache, so the fragments of a packed block cost one device
            // read; raw blocks missing from the cache that are consecutive both logically and
            // physically are read with one request straight into `out` (and not cached, so a
            // long scan does not evict the blocks verification needs).
            let mut k = 0;
            while let Some(&(i, e, done)) = lookups.get(k) {
                let dst_range = i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE;
                if done || !e.is_data() {
                    if !done {
                        out.get_mut(dst_range).unwrap_or(&mut []).fill(0);
                    }
                    k += 1;
                    continue;
                }
                if e.pbn >= self.geo.data_blocks {
                    return Err(Error::Corrupt(format!(
                        "logical block {} maps beyond the data region",
                        lba0 + i as u64
                    )));
                }
                let cached = self.cache.lock().get(e.pbn);
                let mut run = 0usize;
                if let (None, None) = (&cached, e.slot()) {
                    run = 1;
                    let cache = self.cache.lock();
                    while run < READ_RUN_BLOCKS_MAX {
                        match lookups.get(k + run) {
                            Some(&(i2, e2, false))
                                if i2 == i + run
                                    && e2.is_data()
                                    && e2.slot().is_none()
                                    && e2.pbn == e.pbn + run as u64
                                    && e2.pbn < self.geo.data_blocks
                                    && !cache.contains(e2.pbn) =>
                            {
                                run += 1
                            }
                            _ => break,
                        }
                    }
                }
                // A lone block goes through the cache as before (random re-reads hit it).
                if run >= 2 {
                    let dst = out
                        .get_mut(i * BLOCK_SIZE..(i + run) * BLOCK_SIZE)
                        .ok_or_else(|| Error::InvalidArgument("read run".into()))?;
                    self.data.read(IoKind::Data, dst, self.geo.data_offset(e.pbn))?;
                    for (j, &(ij, ej, _)) in lookups.get(k..k + run).unwrap_or(&[]).iter().enumerate() {
                        let got = dst.get(j * BLOCK_SIZE..(j + 1) * BLOCK_SIZE).unwrap_or(&[]);
                        if crc32c::crc32c(got) != ej.crc {
                            self.read_mismatch(lba0, ij, ej, &mut attempts, &mut retry)?;
                        }
                    }
                    k += run;
                    continue;
                }
                let block = match cached {
                    Some(b) => b,
                    None => self.physical_block(e.pbn)?,
                };
                let dst = out.get_mut(dst_range).unwrap_or(&mut []);
                let ok = match e.slot() {
                    None => {
                        dst.copy_from_slice(&block);
                        true
                    }
                    Some(slot) => packer::unpack(&block, slot, dst).is_ok(),
                };
                if !(ok && crc32c::crc32c(dst) == e.crc) {
                    self.read_mismatch(lba0, i, e, &mut attempts, &mut retry)?;
                }
                k += 1;
            }
            todo = retry;
        }
        Ok(())
    }

    /// A block read back with the wrong checksum: drops any cached copy and queues a retry
    /// from a fresh mapping (the block may have been freed and reused meanwhile), or
    /// reports corruption once the attempts are spent.
    fn read_mismatch(
        &self,
        lba0: u64,
        i: usize,
        e: MapEntry,
        attempts: &mut [usize],
        retry: &mut Vec<usize>,
    ) -> Result<()> {
        self.cache.lock().remove(e.pbn);
        let a = attempts.get_mut(i).ok_or_else(|| Error::InvalidArgument("attempt".into()))?;
        *a += 1;
        if *a >= READ_ATTEMPTS {
            self.forget_damaged(&mut self.state.lock(), e.pbn);
            return Err(Error::Corrupt(format!(
                "logical block {} (physical block {}{}): content does not match its checksum",
                lba0 + i as u64,
                e.pbn,
                e.slot().map(|s| format!(" slot {s}")).unwrap_or_default()
            )));
        }
        retry.push(i);
        Ok(())
    }

    /// Takes a block whose stored content failed its checksum out of deduplication: no
    /// index entry may lead a new write to it, since hash verification would trust the
    /// entry and share the damaged copy. A write of the same content then stores a fresh
    /// copy (and a rewrite of the damaged logical block heals it). State lock held.
    pub(crate) fn forget_damaged(&self, st: &mut State, pbn: u64) {
        self.cache.lock().remove(pbn);
        // With reuse stamps, a new stamp makes every entry for the block stale at once; a
        // stamp that wraps to an old value needs the full scan, as at reuse.
        let stale_by_stamp = st.stamps.as_mut().and_then(|s| s.get_mut(pbn as usize)).is_some_and(|s| {
            *s = s.wrapping_add(1);
            *s != 0
        });
        if !stale_by_stamp {
            st.index.remove_pbn(pbn);
        }
    }

    /// A physical block, from the content cache or the device.
    fn physical_block(&self, pbn: u64) -> Result<Block> {
        if let Some(b) = self.cache.lock().get(pbn) {
            return Ok(b);
        }
        let mut b = new_block();
        let buf = Arc::get_mut(&mut b).ok_or_else(|| Error::InvalidArgument("fresh block is shared".into()))?;
        self.data.read(IoKind::Data, buf, self.geo.data_offset(pbn))?;
        self.cache.lock().fill(pbn, b.clone());
        Ok(b)
    }

    /// Memory held by the volume's structures now, in bytes, by structure.
    pub fn memory_usage(&self) -> Vec<(&'static str, u64)> {
        let st = self.state.lock();
        let blocks = self.geo.data_blocks;
        vec![
            ("reference + fragment counts", 2 * blocks),
            ("allocator bitmap", blocks.div_ceil(64) * 8),
            ("reuse stamps", if st.stamps.is_some() { 2 * blocks } else { 0 }),
            ("fingerprint index", st.index.memory_bytes()),
            ("block map cache (pages held now)", st.map.cached_pages() as u64 * BLOCK_SIZE_U64),
            ("content cache (blocks held now)", self.cache.lock().len() as u64 * BLOCK_SIZE_U64),
        ]
    }

    /// Cheap in-memory invariant audit (allocator vs reference counts); for tests and the
    /// simulator. Returns a description of the first violation.
    pub fn audit_memory(&self) -> std::result::Result<(), String> {
        let mut st = self.state.lock();
        st.alloc.audit(st.rc.counts(), &st.packer.open_pbns())?;
        // Every mapping's content, read from the device (or the open packed block), must
        // match its checksum: the cache must never hide a divergence.
        for lba in 0..self.geo.logical_blocks {
            let e = st.map.get(lba).map_err(|e| e.to_string())?;
            if !e.is_data() {
                continue;
            }
            let mut out = vec![0u8; BLOCK_SIZE];
            let ok = match decode_unwritten(&st, &e, &mut out) {
                Some(ok) => ok,
                None => {
                    let mut b = vec![0u8; BLOCK_SIZE];
                    self.data.read(IoKind::Verify, &mut b, self.geo.data_offset(e.pbn)).map_err(|e| e.to_string())?;
                    match e.slot() {
                        None => {
                            out = b;
                            true
                        }
                        Some(s) => packer::unpack(&b, s, &mut out).is_ok(),
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

    // ----------------------------------------------------------------------------------
    // stats
    // ----------------------------------------------------------------------------------

    /// A statistics snapshot.
    pub fn stats(&self) -> Stats {
        let sb = self.sb.lock().clone();
        let st = self.state.lock();
        let mut red = st.red.clone();
        {
            let c = self.cache.lock();
            red.content_cache_hits = c.hits;
            red.content_cache_misses = c.misses;
        }
        red.block_map_cache_hits = st.map.hits;
        red.block_map_cache_misses = st.map.misses;
        let used = st.rc.used_blocks();
        let frags = st.rc.fragments();
        let mapped = st.counters.mapped_blocks;
        let logical_used = mapped * BLOCK_SIZE_U64;
        let physical_used = used * BLOCK_SIZE_U64;
        Stats {
            uuid: uuid_hex(&sb.uuid),
            logical_size_bytes: self.logical_size(),
            logical_bytes_used: logical_used,
            physical_size_bytes: self.data.len(),
            data_blocks_total: self.geo.data_blocks,
            data_blocks_used: used,
            physical_data_bytes_used: physical_used,
            metadata_bytes: self.geo.metadata_bytes(),
            separate_metadata_device: self.geo.meta_dev_blocks > 0,
            reduction_ratio: if physical_used == 0 { 0.0 } else { logical_used as f64 / physical_used as f64 },
            savings: Savings {
                zero_bytes: st.counters.zero_blocks * BLOCK_SIZE_U64,
                dedup_bytes: mapped.saturating_sub(frags) * BLOCK_SIZE_U64,
                compression_bytes: frags.saturating_sub(used) * BLOCK_SIZE_U64,
            },
            lifetime: self.lifetime_now(&st),
            counters: red,
            index_entries: st.index.len(),
            index_capacity: st.index.capacity(),
            index_memory_bytes: st.index.memory_bytes(),
            index_bytes_per_entry: st.index.bytes_per_entry(),
            block_map_cached_pages: st.map.cached_pages() as u64,
            compression: sb.compression,
            dedup: sb.dedup,
            verify: sb.verify,
            write_policy: self.policy,
            io: self.io.snapshot(),
        }
    }
}

/// Blocks placed per state-lock hold by one write (4 MiB): bounds lock hold time and the
/// memory of one batch's plans, whatever the request size.
const WRITE_BLOCKS_PER_BATCH: u64 = 1024;
/// Blocks read per call to `read_blocks` (4 MiB).
const READ_BLOCKS_PER_CALL: u64 = 1024;

/// A piece of a byte range: part of one block, or a run of whole blocks.
struct Segment {
    /// First logical block.
    lba: u64,
    /// Byte offset inside that block (0 for whole blocks).
    within: usize,
    /// Offset of the piece from the start of the range.
    pos: u64,
    /// Length of the piece in bytes.
    len: u64,
    /// True for a run of whole blocks.
    whole: bool,
}

/// Splits `offset..offset+len` into partial-block pieces and whole-block runs of at most
/// `max_blocks` blocks, in order.
fn segments(offset: u64, len: u64, max_blocks: u64) -> impl Iterator<Item = Segment> {
    let mut pos = 0u64;
    std::iter::from_fn(move || {
        if pos >= len {
            return None;
        }
        let off = offset + pos;
        let lba = off / BLOCK_SIZE_U64;
        let within = (off % BLOCK_SIZE_U64) as usize;
        let left = len - pos;
        let seg = if within != 0 || left < BLOCK_SIZE_U64 {
            Segment { lba, within, pos, len: (BLOCK_SIZE_U64 - within as u64).min(left), whole: false }
        } else {
            Segment { lba, within: 0, pos, len: (left / BLOCK_SIZE_U64).min(max_blocks) * BLOCK_SIZE_U64, whole: true }
        };
        pos += seg.len;
        Some(seg)
    })
}

/// Data blocks staged before they are written as one merged write (256 KiB).
const STAGED_BLOCKS_MAX: usize = 64;
/// Staged blocks past which `stage` writes under the lock (a request is at most
/// `WRITE_BLOCKS_PER_BATCH` blocks, so this bounds the buffer at 8 MiB).
const STAGED_BLOCKS_HARD_MAX: usize = 2048;

/// Decodes the logical content `e` refers to when its physical block is not on the device
/// yet (the open packed block, or a staged block). None: read it from the device.
fn decode_unwritten(st: &State, e: &MapEntry, out: &mut [u8]) -> Option<bool> {
    if st.packer.is_open(e.pbn) {
        // The open block is a packed block: a raw mapping to it is stale.
        return Some(e.slot().and_then(|slot| st.packer.unpack_open(e.pbn, slot, out)).is_some_and(|r| r.is_ok()));
    }
    // Newest first: a pbn freed and reused may still sit in an older, completed batch.
    let (_, block) = st
        .staged
        .iter()
        .rev()
        .chain(st.writing.iter().rev().flat_map(|(_, b)| b.iter().rev()))
        .find(|(p, _)| *p == e.pbn)?;
    Some(match e.slot() {
        None => {
            if out.len() == block.len() {
                out.copy_from_slice(block);
                true
            } else {
                false
            }
        }
        Some(slot) => packer::unpack(block, slot, out).is_ok(),
    })
}

/// Chunks per request below which the pipeline stays on the calling thread.
const PARALLEL_CHUNKS_MIN: usize = 64;
/// Threads a single request may use for hashing and compression.
const PARALLEL_THREADS_MAX: usize = 8;

/// Runs `f` on every element, splitting large slices across scoped threads (one request
/// from a single-threaded client, such as an import, still uses every core).
fn par_for_each<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    // Asked once: the answer reads cgroup files, which cost more than hashing a request.
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads =
        *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(PARALLEL_THREADS_MAX));
    if items.len() < PARALLEL_CHUNKS_MIN || threads < 2 {
        for (i, t) in items.iter_mut().enumerate() {
            f(i, t);
        }
        return;
    }
    let per = items.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (k, part) in items.chunks_mut(per).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, t) in part.iter_mut().enumerate() {
                    f(k * per + j, t);
                }
            });
        }
    });
}

/// A zeroed, unshared block, allocated once (`Arc::from(Vec)` would copy it).
fn new_block() -> Block {
    std::iter::repeat_n(0u8, BLOCK_SIZE).collect()
}

/// True when `block` (raw or packed, per `state`) holds `chunk`.
fn content_matches(block: &[u8], state: u8, chunk: &[u8]) -> bool {
    let e = MapEntry { pbn: 0, state, crc: 0 };
    if state == STATE_RAW {
        return block == chunk;
    }
    match e.slot() {
        Some(slot) => {
            let mut out = [0u8; BLOCK_SIZE];
            packer::unpack(block, slot, &mut out).is_ok() && out == chunk
        }
        None => false,
    }
}

/// Magic of the index save area's header block ("DVIX").
const INDEX_MAGIC: u32 = u32::from_le_bytes(*b"DVIX");

/// Reads the saved index: a header block (magic, crc of the entries, count, entry size,
/// uuid) and the entries after it.
fn load_index(meta: &Dev, geo: &Geometry, ulo: u64, count: u64, per: u64) -> Result<Vec<u8>> {
    use crate::codec::{get_u32, get_u64};
    let mut head = vec![0u8; BLOCK_SIZE];
    meta.read(IoKind::Index, &mut head, geo.index_start * BLOCK_SIZE_U64)?;
    if get_u32(&head, 0) != INDEX_MAGIC
        || get_u64(&head, 24) != ulo
        || get_u64(&head, 8) != count
        || u64::from(get_u32(&head, 16)) != per
    {
        return Err(Error::Corrupt("index save area header does not match the superblock".into()));
    }
    let len = count * per;
    if len > geo.index_blocks.saturating_sub(1) * BLOCK_SIZE_U64 {
        return Err(Error::Corrupt("saved index larger than its area".into()));
    }
    let mut bytes = vec![0u8; len as usize];
    meta.read(IoKind::Index, &mut bytes, (geo.index_start + 1) * BLOCK_SIZE_U64)?;
    if crc32c::crc32c(&bytes) != get_u32(&head, 4) {
        return Err(Error::Corrupt("saved index checksum mismatch".into()));
    }
    Ok(bytes)
}

impl Volume {
    /// Saves the fingerprint index into its area (clean close); returns entries saved.
    fn save_index(&self, st: &State) -> Result<u64> {
        if !self.dedup || self.geo.index_blocks < 2 {
            return Ok(0);
        }
        let per = st.index.bytes_per_entry();
        let room = (self.geo.index_blocks - 1) * BLOCK_SIZE_U64 / per;
        let (n, mut bytes) = st.index.export(|l| {
            let valid = st.rc.get(l.pbn) > 0 && st.stamp_matches(&l);
            valid.then_some(Location { stamp: 0, ..l })
        });
        let n = n.min(room);
        bytes.truncate((n * per) as usize);
        let mut head = vec![0u8; BLOCK_SIZE];
        crate::codec::put_u32(&mut head, 0, INDEX_MAGIC);
        crate::codec::put_u32(&mut head, 4, crc32c::crc32c(&bytes));
        crate::codec::put_u64(&mut head, 8, n);
        crate::codec::put_u32(&mut head, 16, per as u32);
        crate::codec::put_u64(&mut head, 24, uuid_lo(&self.sb.lock().uuid));
        bytes.resize(bytes.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
        self.meta.write(IoKind::Index, &bytes, (self.geo.index_start + 1) * BLOCK_SIZE_U64)?;
        self.meta.write(IoKind::Index, &head, self.geo.index_start * BLOCK_SIZE_U64)?;
        self.meta.sync()?;
        Ok(n)
    }
}

impl Volume {
    /// The lifetime counters as of now: those loaded at open plus this process's.
    fn lifetime_now(&self, st: &State) -> LifetimeCounters {
        self.lifetime_base.plus_process(&st.red, &self.io.snapshot())
    }

    /// Writes the superblock copies with the lifetime counters as of now (after a
    /// checkpoint; close writes them too), so a crash loses at most the counts since the
    /// last checkpoint. Rare enough to cost nothing: a checkpoint frees half the journal.
    fn persist_lifetime(&self, st: &State) -> Result<()> {
        let mut sb = self.sb.lock();
        sb.lifetime = self.lifetime_now(st);
        write_superblock(&self.data, self.separate_meta(), &mut sb)
    }

    /// The metadata device when it is not the data device.
    fn separate_meta(&self) -> Option<&Dev> {
        (self.geo.meta_dev_blocks > 0).then_some(&self.meta)
    }
}

/// Writes a new generation of the superblock: the metadata device's copies first (when
/// separate), then the data device's, in the order `format` writes them.
fn write_superblock(data: &Dev, meta: Option<&Dev>, sb: &mut Superblock) -> Result<()> {
    sb.generation += 1;
    if let Some(m) = meta {
        write_copies(m, sb, 1)?;
    }
    write_copies(data, sb, 0)
}

/// Writes both superblock copies (A, sync, B, sync).
fn write_copies(dev: &Dev, sb: &Superblock, role: u8) -> Result<()> {
    let buf = sb.encode(role);
    for copy in 0..2u64 {
        dev.write(IoKind::Superblock, &buf, copy * BLOCK_SIZE_U64)?;
        dev.sync()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DedupVerify;
    use crate::io::MemStorage;

    /// With hash verification, a block whose 16-bit reuse stamp wraps must lose every index
    /// entry pointing at it: an entry made 65536 reuses ago would match the stamp again and
    /// share the block's new, different content.
    #[test]
    fn reuse_stamp_wrap_purges_the_index() {
        let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
        let opts = FormatOptions {
            logical_size_bytes: 16 << 20,
            index_memory_bytes: 1 << 20,
            slab_size_bytes: 1 << 20,
            verify: DedupVerify::Hash,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), None, &opts, false).expect("format");
        let vol = Volume::open(dev, None, &OpenOptions::default()).expect("open");
        let a: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 7 % 251) as u8).collect();
        let b: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 13 % 241) as u8).collect();
        vol.write(0, &a, false).expect("write a");
        vol.flush().expect("flush");
        let ha = *blake3::hash(&a).as_bytes();
        let pbn = {
            let mut st = vol.state.lock();
            let pbn = st.map.get(0).expect("map").pbn;
            assert_eq!(st.index.lookup(&ha).map(|l| (l.pbn, l.stamp)), Some((pbn, 0)));
            // As if the block had been freed and reused 65535 times since.
            if let Some(s) = st.stamps.as_mut().and_then(|s| s.get_mut(pbn as usize)) {
                *s = u16::MAX;
            }
            pbn
        };
        vol.write(0, &b, false).expect("overwrite frees the block");
        let st = vol.state.lock();
        assert_eq!(st.stamps.as_ref().and_then(|s| s.get(pbn as usize)).copied(), Some(0));
        assert_eq!(st.index.lookup(&ha), None, "stale entry survived the stamp wrap");
        assert_eq!(st.red.stamp_wrap_scans, 1);
    }

    /// Raw blocks missing from the cache are read in merged runs; a damaged block inside a
    /// run is an error for that block only, and its neighbours still read back.
    #[test]
    fn merged_raw_reads_check_every_block() {
        let dev = Arc::new(MemStorage::new(64 << 20));
        let opts = FormatOptions {
            logical_size_bytes: 16 << 20,
            index_memory_bytes: 1 << 20,
            slab_size_bytes: 1 << 20,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), None, &opts, false).expect("format");
        let small = OpenOptions { content_cache_bytes: 64 << 10, ..OpenOptions::default() };
        let vol = Volume::open(dev.clone(), None, &small).expect("open");
        let data = crate::codec::test_random_bytes(0x1234_5678_9abc_def1, 200 * BLOCK_SIZE);
        vol.write(0, &data, false).expect("write");
        vol.flush().expect("flush");
        let mut back = vec![0u8; data.len()];
        vol.read(0, &mut back).expect("read");
        assert!(back == data, "merged read returned different bytes");
        let pbn = vol.state.lock().map.get(50).expect("map").pbn;
        assert!(vol.state.lock().map.get(51).expect("map").pbn == pbn + 1, "raw blocks are laid out in order");
        dev.write_at(&[0xee; 16], vol.geo.data_offset(pbn) + 100).expect("damage");
        vol.cache.lock().remove(pbn);
        let mut one = vec![0u8; BLOCK_SIZE];
        assert!(matches!(vol.read(50 * BLOCK_SIZE_U64, &mut one), Err(Error::Corrupt(_))));
        let mut run = vec![0u8; 40 * BLOCK_SIZE];
        assert!(matches!(vol.read(30 * BLOCK_SIZE_U64, &mut run), Err(Error::Corrupt(_))));
        vol.read(0, &mut back[..50 * BLOCK_SIZE]).expect("blocks before the damage");
        assert!(back[..50 * BLOCK_SIZE] == data[..50 * BLOCK_SIZE]);
        vol.read(51 * BLOCK_SIZE_U64, &mut back[51 * BLOCK_SIZE..]).expect("blocks after the damage");
        assert!(back[51 * BLOCK_SIZE..] == data[51 * BLOCK_SIZE..]);
    }
}
