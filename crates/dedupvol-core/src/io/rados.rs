//! A device whose bytes live in Ceph RADOS objects (`rados://POOL/NAME`).
//!
//! The device's byte space is cut into objects of `OBJECT_BYTES` (4 MiB): byte `b` lives in
//! object `NAME.<b / OBJECT_BYTES as 16 hex digits>` at offset `b % OBJECT_BYTES`. The
//! header object `NAME` carries the device size (xattr `dedupvol.bytes`, fixed at
//! creation) and the volume's lock. An object never written reads as zeroes.
//!
//! Invariants:
//! - `write_at` queues asynchronous writes (librados copies the bytes); `sync` waits for
//!   every write queued before it and reports the first failure since the last `sync`.
//!   RADOS completes a write only once every replica in the acting set has it on stable
//!   storage, so a completed write is durable (docs/format.md, media assumptions).
//! - A read waits first for queued writes to the objects it reads, so it sees them.
//! - At most `IN_FLIGHT_MAX` writes and `IN_FLIGHT_BYTES_MAX` bytes are queued: a writer
//!   past either waits for the oldest. librados's own budget for operations in flight is
//!   raised to at least `OBJECTER_OPS_MIN` and `OBJECTER_BYTES_MIN`, well above that, so
//!   no call waits inside librados for budget: librados arms an operation's timeout
//!   (`rados_osd_op_timeout`) only once the operation has its budget, so a call waiting
//!   there (holding the queue's lock) would wait with no timeout at all, and every other
//!   reader and writer of the device behind it.
//! - With an operation timeout configured (`rados_osd_op_timeout`), every wait for the
//!   cluster gives up after twice it plus `DEADLINE_SLACK` whatever librados does: a read
//!   (`read_with_deadline`; callers read block-map pages under the volume's state lock)
//!   and the wait for a queued write (`retire_oldest`; a flush, or a write waiting for
//!   room in the queue). A read given up on keeps its buffer until librados completes it;
//!   a write given up on fails the next `sync`, as a failed write does. Without one,
//!   reads and writes wait for the cluster as long as it takes.
//! - A read-write device holds the exclusive lock `dedupvol` on the header object for as
//!   long as it is open, a read-only one a shared lock: a second writer gets
//!   `Error::InUse` naming the holder, unless it takes the volume over (`take_over`): it
//!   then blocklists every holder's client address (fencing: the OSDs refuse anything a
//!   holder still sends), breaks their locks and takes its own.
//!
//! librados is loaded at run time (`dlopen` of `librados.so.2`), so building the engine
//! needs no Ceph development files and only `rados://` volumes need the library.

use super::Storage;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::path::Path;
use std::sync::OnceLock;

/// Bytes per data object (a power of two; RADOS's default maximum object is 128 MiB).
pub const OBJECT_BYTES: u64 = 4 << 20;
/// Writes queued before a writer waits for the oldest (bounds memory: librados holds a copy).
const IN_FLIGHT_MAX: usize = 256;
/// Bytes of queued writes before a writer waits for the oldest.
const IN_FLIGHT_BYTES_MAX: usize = 64 << 20;
/// The least budget librados is given for operations in flight (`objecter_inflight_ops`,
/// default 1,024) and their bytes (`objecter_inflight_op_bytes`, default 100 MiB): room for
/// every queued write plus reads of every thread beside them.
const OBJECTER_OPS_MIN: u64 = 1024;
const OBJECTER_BYTES_MIN: u64 = 256 << 20;
const _: () =
    assert!(IN_FLIGHT_MAX as u64 * 2 <= OBJECTER_OPS_MIN && IN_FLIGHT_BYTES_MAX as u64 * 2 <= OBJECTER_BYTES_MIN);
/// Added to twice the operation timeout to make a request's deadline (`Conn::deadline`).
const DEADLINE_SLACK: std::time::Duration = std::time::Duration::from_secs(5);
/// Name of the lock on the header object.
const LOCK_NAME: &str = "dedupvol";
/// Tag shared by every holder of the shared (read-only) lock.
const LOCK_TAG: &str = "dedupvol-readers";
/// Extended attribute of the header object holding the device size in decimal.
const SIZE_XATTR: &str = "dedupvol.bytes";
/// How long a fenced holder stays blocklisted (an hour: far longer than any request).
const BLOCKLIST_SECONDS: u32 = 3600;
/// URL prefix that selects this device.
pub const URL_PREFIX: &str = "rados://";
/// Longest pool or object name accepted (RADOS allows more; names are typed by people).
const NAME_BYTES_MAX: usize = 200;

type RadosT = *mut c_void;
type IoctxT = *mut c_void;
type CompletionT = *mut c_void;

/// The few librados entry points the device uses, resolved once from `librados.so.2`.
struct Api {
    create: unsafe extern "C" fn(*mut RadosT, *const c_char) -> c_int,
    conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    conf_parse_env: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    conf_get: unsafe extern "C" fn(RadosT, *const c_char, *mut c_char, usize) -> c_int,
    conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    connect: unsafe extern "C" fn(RadosT) -> c_int,
    shutdown: unsafe extern "C" fn(RadosT),
    ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoctxT) -> c_int,
    ioctx_destroy: unsafe extern "C" fn(IoctxT),
    read: unsafe extern "C" fn(IoctxT, *const c_char, *mut c_char, usize, u64) -> c_int,
    write_full: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, usize) -> c_int,
    getxattr: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, *mut c_char, usize) -> c_int,
    setxattr: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, *const c_char, usize) -> c_int,
    aio_create_completion: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, *mut CompletionT) -> c_int,
    aio_write: unsafe extern "C" fn(IoctxT, *const c_char, CompletionT, *const c_char, usize, u64) -> c_int,
    aio_read: unsafe extern "C" fn(IoctxT, *const c_char, CompletionT, *mut c_char, usize, u64) -> c_int,
    aio_wait_for_complete: unsafe extern "C" fn(CompletionT) -> c_int,
    aio_get_return_value: unsafe extern "C" fn(CompletionT) -> c_int,
    aio_release: unsafe extern "C" fn(CompletionT),
    lock_exclusive: unsafe extern "C" fn(
        IoctxT,
        *const c_char,
        *const c_char,
        *const c_char,
        *const c_char,
        *mut c_void,
        u8,
    ) -> c_int,
    lock_shared: unsafe extern "C" fn(
        IoctxT,
        *const c_char,
        *const c_char,
        *const c_char,
        *const c_char,
        *const c_char,
        *mut c_void,
        u8,
    ) -> c_int,
    unlock: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, *const c_char) -> c_int,
    list_lockers: unsafe extern "C" fn(
        IoctxT,
        *const c_char,
        *const c_char,
        *mut c_int,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
    ) -> isize,
    break_lock: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, *const c_char, *const c_char) -> c_int,
    blocklist_add: unsafe extern "C" fn(RadosT, *mut c_char, u32) -> c_int,
    wait_for_latest_osdmap: unsafe extern "C" fn(RadosT) -> c_int,
}

/// Resolves one symbol as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's true C signature as a function pointer type.
unsafe fn sym<T: Copy>(lib: *mut c_void, name: &CStr) -> std::result::Result<T, String> {
    // SAFETY: `lib` is a live handle from dlopen; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("librados.so.2 has no {}", name.to_string_lossy()));
    }
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller names the symbol's signature; function pointers are pointer-sized.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: a constant NUL-terminated name; the handle is never closed (the
        // function pointers live for the whole process).
        let lib = unsafe { libc::dlopen(c"librados.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err("cannot load librados.so.2 (Debian: apt install librados2)".to_string());
        }
        // SAFETY: every type below is the signature librados.h declares for the symbol.
        unsafe {
            Ok(Api {
                create: sym(lib, c"rados_create")?,
                conf_read_file: sym(lib, c"rados_conf_read_file")?,
                conf_parse_env: sym(lib, c"rados_conf_parse_env")?,
                conf_get: sym(lib, c"rados_conf_get")?,
                conf_set: sym(lib, c"rados_conf_set")?,
                connect: sym(lib, c"rados_connect")?,
                shutdown: sym(lib, c"rados_shutdown")?,
                ioctx_create: sym(lib, c"rados_ioctx_create")?,
                ioctx_destroy: sym(lib, c"rados_ioctx_destroy")?,
                read: sym(lib, c"rados_read")?,
                write_full: sym(lib, c"rados_write_full")?,
                getxattr: sym(lib, c"rados_getxattr")?,
                setxattr: sym(lib, c"rados_setxattr")?,
                aio_create_completion: sym(lib, c"rados_aio_create_completion")?,
                aio_write: sym(lib, c"rados_aio_write")?,
                aio_read: sym(lib, c"rados_aio_read")?,
                aio_wait_for_complete: sym(lib, c"rados_aio_wait_for_complete")?,
                aio_get_return_value: sym(lib, c"rados_aio_get_return_value")?,
                aio_release: sym(lib, c"rados_aio_release")?,
                lock_exclusive: sym(lib, c"rados_lock_exclusive")?,
                lock_shared: sym(lib, c"rados_lock_shared")?,
                unlock: sym(lib, c"rados_unlock")?,
                list_lockers: sym(lib, c"rados_list_lockers")?,
                break_lock: sym(lib, c"rados_break_lock")?,
                blocklist_add: sym(lib, c"rados_blocklist_add")?,
                wait_for_latest_osdmap: sym(lib, c"rados_wait_for_latest_osdmap")?,
            })
        }
    })
    .as_ref()
    .map_err(|e| Error::InvalidArgument(e.clone()))
}

/// A negative errno from librados as an `io::Error`.
fn rados_err(r: i64) -> io::Error {
    io::Error::from_raw_os_error(i32::try_from(-r).unwrap_or(libc::EIO))
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{s:?} contains a NUL byte")))
}

/// `rados://POOL/NAME`, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RadosUrl {
    pub pool: String,
    pub name: String,
}

impl RadosUrl {
    /// `None` when `path` is not a `rados://` URL; an error when it is one, malformed.
    pub fn parse(path: &Path) -> Option<Result<RadosUrl>> {
        let s = path.to_str()?;
        let rest = s.strip_prefix(URL_PREFIX)?;
        let ok = |part: &str| {
            !part.is_empty()
                && part.len() <= NAME_BYTES_MAX
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        Some(match rest.split_once('/') {
            Some((pool, name)) if ok(pool) && ok(name) => {
                Ok(RadosUrl { pool: pool.to_string(), name: name.to_string() })
            }
            _ => Err(Error::InvalidArgument(format!(
                "{s:?}: a RADOS device is rados://POOL/NAME (letters, digits, '.', '_', '-')"
            ))),
        })
    }
}

impl std::fmt::Display for RadosUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{URL_PREFIX}{}/{}", self.pool, self.name)
    }
}

/// A connected cluster handle and an I/O context on the pool; shut down on drop.
struct Conn {
    api: &'static Api,
    cluster: RadosT,
    ioctx: IoctxT,
    /// How long a request may take before the device gives up on it (`Conn::op_deadline`).
    deadline: Option<std::time::Duration>,
}

// SAFETY: librados cluster handles and I/O contexts are thread-safe (librados.h).
unsafe impl Send for Conn {}
// SAFETY: as above.
unsafe impl Sync for Conn {}

impl Conn {
    /// Connects as `client.admin` (a take-over blocklists, which needs the monitor's
    /// permission) with the configuration librados finds (`$CEPH_CONF`, else
    /// /etc/ceph/ceph.conf, then `CEPH_ARGS`) and opens `pool`.
    fn connect(pool: &str) -> Result<Conn> {
        let api = api()?;
        let ctx = |what: &str, r: c_int| Error::io(format!("RADOS: {what}"), rados_err(r.into()));
        let mut cluster: RadosT = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a null id means client.admin.
        let r = unsafe { (api.create)(&mut cluster, std::ptr::null()) };
        if r < 0 {
            return Err(ctx("creating a cluster handle", r));
        }
        let mut conn = Conn { api, cluster, ioctx: std::ptr::null_mut(), deadline: None };
        // SAFETY: `cluster` was just created; null arguments select the defaults.
        unsafe {
            let r = (api.conf_read_file)(conn.cluster, std::ptr::null());
            if r < 0 {
                return Err(ctx("reading the Ceph configuration ($CEPH_CONF or /etc/ceph/ceph.conf)", r));
            }
            let r = (api.conf_parse_env)(conn.cluster, std::ptr::null());
            if r < 0 {
                return Err(ctx("parsing CEPH_ARGS", r));
            }
            conn.deadline = conn.op_deadline();
            conn.raise_option(c"objecter_inflight_ops", OBJECTER_OPS_MIN)?;
            conn.raise_option(c"objecter_inflight_op_bytes", OBJECTER_BYTES_MIN)?;
            let r = (api.connect)(conn.cluster);
            if r < 0 {
                return Err(ctx("connecting to the cluster", r));
            }
        }
        let p = cstr(pool)?;
        // SAFETY: connected handle, NUL-terminated pool name, out-pointer into `conn`.
        let r = unsafe { (api.ioctx_create)(conn.cluster, p.as_ptr(), &mut conn.ioctx) };
        if r < 0 {
            return Err(ctx(&format!("opening pool {pool}"), r));
        }
        Ok(conn)
    }
}

impl Conn {
    /// The deadline of a request when the configuration sets an operation timeout
    /// (`rados_osd_op_timeout`, in seconds): twice it plus `DEADLINE_SLACK`. None without
    /// one: requests then wait for the cluster as long as it takes.
    fn op_deadline(&self) -> Option<std::time::Duration> {
        let secs = self.conf_number(c"rados_osd_op_timeout")?;
        (secs.is_finite() && secs > 0.0)
            .then(|| std::time::Duration::from_secs_f64(secs.min(86_400.0) * 2.0) + DEADLINE_SLACK)
    }

    /// The numeric value of option `name` in the configuration; None when it is unknown or
    /// not a number.
    fn conf_number(&self, name: &CStr) -> Option<f64> {
        let mut buf = [0u8; 32];
        // SAFETY: created handle, NUL-terminated name, `buf` valid for its length.
        let r = unsafe { (self.api.conf_get)(self.cluster, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let value = CStr::from_bytes_until_nul(&buf).ok()?.to_str().ok()?.trim().parse::<f64>().ok();
        value.filter(|_| r == 0)
    }

    /// Sets the numeric option `name` to `least` unless the configuration already gives
    /// it more (before `connect`: librados reads these when it starts). A librados that
    /// does not know the option is left as it is.
    fn raise_option(&self, name: &CStr, least: u64) -> Result<()> {
        if self.conf_number(name).is_some_and(|v| v >= least as f64) {
            return Ok(());
        }
        let value = cstr(&least.to_string())?;
        // SAFETY: created handle, NUL-terminated name and value.
        let r = unsafe { (self.api.conf_set)(self.cluster, name.as_ptr(), value.as_ptr()) };
        if r < 0 && r != -libc::ENOENT {
            let what = format!("RADOS: setting {} to {least}", name.to_string_lossy());
            return Err(Error::io(what, rados_err(r.into())));
        }
        Ok(())
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: handles created by `connect`, destroyed once, the I/O context first.
        unsafe {
            if !self.ioctx.is_null() {
                (self.api.ioctx_destroy)(self.ioctx);
            }
            (self.api.shutdown)(self.cluster);
        }
    }
}

/// A request issued with a deadline (`RadosStorage::issue`): librados reads into
/// `buf` (empty for a write) and the completion callback sets `done`. Shared between the
/// waiter and the callback, so a read the waiter gave up on keeps its buffer until
/// librados is done with it.
struct Slot {
    buf: Mutex<Vec<u8>>,
    done: Mutex<bool>,
    cond: parking_lot::Condvar,
}

impl Slot {
    fn new(bytes: usize) -> std::sync::Arc<Slot> {
        std::sync::Arc::new(Slot {
            buf: Mutex::new(vec![0u8; bytes]),
            done: Mutex::new(false),
            cond: parking_lot::Condvar::new(),
        })
    }

    /// Waits for the callback until `deadline` has passed; true when it ran.
    fn wait(&self, deadline: std::time::Duration) -> bool {
        let until = std::time::Instant::now() + deadline;
        let mut done = self.done.lock();
        while !*done {
            if self.cond.wait_until(&mut done, until).timed_out() {
                break;
            }
        }
        *done
    }
}

/// Completion callback of a request with a deadline; `arg` is the `Slot` reference
/// handed to librados with the request.
extern "C" fn slot_done(_c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` came from `Arc::into_raw` in `issue`, for this callback alone,
    // which librados calls once.
    let slot = unsafe { std::sync::Arc::from_raw(arg.cast_const().cast::<Slot>()) };
    *slot.done.lock() = true;
    slot.cond.notify_all();
}

/// One queued asynchronous write.
struct Pending {
    object: u64,
    bytes: usize,
    completion: CompletionT,
    /// Its completion flag, when the device has a deadline.
    slot: Option<std::sync::Arc<Slot>>,
}

// SAFETY: a completion may be waited on and released from any thread.
unsafe impl Send for Pending {}

/// The writes queued since the last wait, oldest first, and the first failure since the
/// last `sync`.
#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    /// Bytes of the pending writes.
    bytes: usize,
    failed: Option<io::Error>,
    /// A write was given up on at its deadline: the cluster does not answer, so the
    /// writes after it are given up on unless already answered (a flush or a close waits
    /// one deadline, not one per queued write); cleared by the next write answered.
    gave_up: bool,
}

/// A device in RADOS objects (see the module documentation).
pub struct RadosStorage {
    conn: Conn,
    url: RadosUrl,
    header: CString,
    len: u64,
    /// Lock cookie of this open (`None`: the device holds no lock).
    cookie: Option<CString>,
    queue: Mutex<Queue>,
}

/// Who holds the lock on a header object.
struct Locker {
    client: String,
    cookie: String,
    addr: String,
}

impl RadosStorage {
    /// Opens an existing device. `take_over`: fence and unlock whoever holds it (see the
    /// module documentation).
    pub fn open(url: &RadosUrl, read_only: bool, take_over: bool) -> Result<RadosStorage> {
        let dev = Self::connect(url)?;
        let len = dev.stored_len()?.ok_or_else(|| Error::InvalidArgument(format!("{url}: no such RADOS device")))?;
        dev.with_len(len).locked(read_only, take_over)
    }

    /// Opens the device, creating it with `size_bytes` when it does not exist (the size of
    /// an existing one cannot change: RADOS devices do not grow).
    pub fn create(url: &RadosUrl, size_bytes: Option<u64>) -> Result<RadosStorage> {
        let dev = Self::connect(url)?;
        let len = match (dev.stored_len()?, size_bytes) {
            (Some(len), None) => len,
            (Some(len), Some(want)) if want == len => len,
            (Some(len), Some(want)) => {
                return Err(Error::InvalidArgument(format!(
                    "{url} exists with {len} bytes; a RADOS device keeps its size (asked for {want})"
                )))
            }
            (None, Some(want)) => {
                if want == 0 || want % crate::config::BLOCK_SIZE_U64 != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "{url}: size {want} must be a positive multiple of the block size"
                    )));
                }
                dev.store_len(want)?;
                want
            }
            (None, None) => {
                return Err(Error::InvalidArgument(format!(
                    "{url} does not exist: give its size (--physical-size) to create it"
                )))
            }
        };
        dev.with_len(len).locked(false, false)
    }

    fn connect(url: &RadosUrl) -> Result<RadosStorage> {
        Ok(RadosStorage {
            conn: Conn::connect(&url.pool)?,
            url: url.clone(),
            header: cstr(&url.name)?,
            len: 0,
            cookie: None,
            queue: Mutex::new(Queue::default()),
        })
    }

    fn with_len(mut self, len: u64) -> Self {
        self.len = len;
        self
    }

    fn ioerr(&self, what: &str, r: i64) -> Error {
        Error::io(format!("{}: {what}", self.url), rados_err(r))
    }

    /// The size recorded on the header object, `None` when there is none.
    fn stored_len(&self) -> Result<Option<u64>> {
        let mut buf = [0u8; 32];
        let name = cstr(SIZE_XATTR)?;
        // SAFETY: live I/O context, NUL-terminated names, `buf` valid for its length.
        let r = unsafe {
            (self.conn.api.getxattr)(
                self.conn.ioctx,
                self.header.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if r == -libc::ENOENT || r == -libc::ENODATA {
            return Ok(None);
        }
        if r < 0 {
            return Err(self.ioerr("reading the device size", r.into()));
        }
        let text = buf.get(..r.unsigned_abs() as usize).and_then(|b| std::str::from_utf8(b).ok());
        text.and_then(|t| t.parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| Error::corruption("RADOS device header", 0, "its size in decimal", format!("{text:?}")))
    }

    fn store_len(&self, len: u64) -> Result<()> {
        let api = self.conn.api;
        let text = len.to_string();
        let name = cstr(SIZE_XATTR)?;
        // SAFETY: live I/O context, NUL-terminated names, buffers valid for their lengths.
        let r = unsafe { (api.write_full)(self.conn.ioctx, self.header.as_ptr(), c"".as_ptr(), 0) };
        if r < 0 {
            return Err(self.ioerr("creating the header object", r.into()));
        }
        // SAFETY: as above.
        let r = unsafe {
            (api.setxattr)(self.conn.ioctx, self.header.as_ptr(), name.as_ptr(), text.as_ptr().cast(), text.len())
        };
        if r < 0 {
            return Err(self.ioerr("recording the device size", r.into()));
        }
        Ok(())
    }

    /// Takes the lock (exclusive for a writer, shared for a reader), fencing and breaking
    /// the holders' locks first when `take_over`.
    fn locked(mut self, read_only: bool, take_over: bool) -> Result<Self> {
        let cookie = cstr(&format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        ))?;
        if take_over {
            self.fence_holders()?;
        }
        let api = self.conn.api;
        let name = cstr(LOCK_NAME)?;
        let desc = cstr(&format!("dedupvol pid {}", std::process::id()))?;
        // SAFETY: live I/O context, NUL-terminated strings, no duration (held until unlocked
        // or broken), no flags.
        let r = unsafe {
            if read_only {
                let tag = cstr(LOCK_TAG)?;
                (api.lock_shared)(
                    self.conn.ioctx,
                    self.header.as_ptr(),
                    name.as_ptr(),
                    cookie.as_ptr(),
                    tag.as_ptr(),
                    desc.as_ptr(),
                    std::ptr::null_mut(),
                    0,
                )
            } else {
                (api.lock_exclusive)(
                    self.conn.ioctx,
                    self.header.as_ptr(),
                    name.as_ptr(),
                    cookie.as_ptr(),
                    desc.as_ptr(),
                    std::ptr::null_mut(),
                    0,
                )
            }
        };
        if r == -libc::EBUSY || r == -libc::EEXIST {
            let holders = self.lockers()?;
            let who: Vec<String> = holders.iter().map(|l| format!("{} at {}", l.client, l.addr)).collect();
            return Err(Error::InUse(format!(
                "{} is open elsewhere (RADOS lock held by {}); if that server is dead, take the volume over (--take-over)",
                self.url,
                if who.is_empty() { "another client".to_string() } else { who.join(", ") }
            )));
        }
        if r < 0 {
            return Err(self.ioerr("taking the volume lock", r.into()));
        }
        self.cookie = Some(cookie);
        Ok(self)
    }

    /// Every holder of the lock on the header object.
    fn lockers(&self) -> Result<Vec<Locker>> {
        let name = cstr(LOCK_NAME)?;
        let mut cap = 4096usize;
        // Bounded: librados says how much room it needs; two rounds always suffice.
        for _ in 0..3 {
            let (mut tag, mut clients, mut cookies, mut addrs) =
                (vec![0u8; cap], vec![0u8; cap], vec![0u8; cap], vec![0u8; cap]);
            let (mut tl, mut cl, mut kl, mut al) = (cap, cap, cap, cap);
            let mut exclusive: c_int = 0;
            // SAFETY: live I/O context, NUL-terminated names, every buffer valid for the
            // length passed beside it.
            let r = unsafe {
                (self.conn.api.list_lockers)(
                    self.conn.ioctx,
                    self.header.as_ptr(),
                    name.as_ptr(),
                    &mut exclusive,
                    tag.as_mut_ptr().cast(),
                    &mut tl,
                    clients.as_mut_ptr().cast(),
                    &mut cl,
                    cookies.as_mut_ptr().cast(),
                    &mut kl,
                    addrs.as_mut_ptr().cast(),
                    &mut al,
                )
            };
            if r == -(libc::ERANGE as isize) {
                cap = tl.max(cl).max(kl).max(al).max(cap * 2).min(1 << 20);
                continue;
            }
            if r < 0 {
                return Err(self.ioerr("listing the volume lock's holders", r as i64));
            }
            let split = |b: &[u8], l: usize| -> Vec<String> {
                b.get(..l.min(b.len()))
                    .unwrap_or_default()
                    .split(|&c| c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect()
            };
            let (c, k, a) = (split(&clients, cl), split(&cookies, kl), split(&addrs, al));
            return Ok(c
                .into_iter()
                .zip(k)
                .zip(a)
                .map(|((client, cookie), addr)| Locker { client, cookie, addr })
                .collect());
        }
        Err(Error::internal("listing RADOS lock holders", "librados kept asking for more room"))
    }

    /// Blocklists every holder of the lock (its pending and future requests are refused
    /// by the OSDs) and breaks its lock.
    fn fence_holders(&self) -> Result<()> {
        let api = self.conn.api;
        let name = cstr(LOCK_NAME)?;
        let holders = self.lockers()?;
        for l in &holders {
            let mut addr = cstr(&l.addr)?.into_bytes_with_nul();
            // SAFETY: connected handle; `addr` is a NUL-terminated buffer librados only reads.
            let r = unsafe { (api.blocklist_add)(self.conn.cluster, addr.as_mut_ptr().cast(), BLOCKLIST_SECONDS) };
            if r < 0 {
                return Err(
                    self.ioerr(&format!("blocklisting the previous holder {} at {}", l.client, l.addr), r.into())
                );
            }
            let (client, cookie) = (cstr(&l.client)?, cstr(&l.cookie)?);
            // SAFETY: live I/O context, NUL-terminated strings.
            let r = unsafe {
                (api.break_lock)(self.conn.ioctx, self.header.as_ptr(), name.as_ptr(), client.as_ptr(), cookie.as_ptr())
            };
            if r < 0 && r != -libc::ENOENT {
                return Err(self.ioerr(&format!("breaking the lock of {}", l.client), r.into()));
            }
        }
        if !holders.is_empty() {
            // Our requests then carry the OSD map that blocklists the old holders: an OSD
            // serving one of them refuses theirs from then on.
            // SAFETY: connected handle.
            let r = unsafe { (api.wait_for_latest_osdmap)(self.conn.cluster) };
            if r < 0 {
                return Err(self.ioerr("waiting for the OSD map with the blocklist", r.into()));
            }
        }
        Ok(())
    }

    fn object_name(&self, object: u64) -> io::Result<CString> {
        CString::new(format!("{}.{object:016x}", self.url.name)).map_err(io::Error::other)
    }

    /// Splits `[offset, offset + len)` into (object, offset in object, offset in the
    /// request, length) pieces, after checking it lies within the device.
    fn pieces(&self, offset: u64, len: usize) -> io::Result<Vec<(u64, u64, usize, usize)>> {
        if offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "access beyond the end of the RADOS device"));
        }
        let mut out = Vec::with_capacity(len / OBJECT_BYTES as usize + 2);
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let within = pos % OBJECT_BYTES;
            let n = (len - done).min((OBJECT_BYTES - within) as usize);
            out.push((pos / OBJECT_BYTES, within, done, n));
            done += n;
        }
        Ok(out)
    }

    /// Reads `dst.len()` bytes at `within` of object `oid` as `rados_read` would (its
    /// return value), but gives up after `deadline` with `TimedOut`. Why: callers read
    /// block-map pages under the volume's state lock (every writer behind it), so a read's
    /// wait is bounded here whatever librados does. (With every OSD down, librados itself
    /// ended each read at its operation timeout; the minutes once seen under the lock were
    /// a map scan asking again for each entry of an unreadable page.) The read goes into a
    /// buffer shared with the completion callback, so a read given up on keeps its buffer
    /// until librados is done with it (memory bounded by the reads outstanding).
    fn read_with_deadline(
        &self,
        oid: &CStr,
        dst: &mut [u8],
        within: u64,
        deadline: std::time::Duration,
    ) -> io::Result<c_int> {
        let api = self.conn.api;
        let n = dst.len();
        let slot = Slot::new(n);
        // The vector is never resized: its memory stays where it is while `slot` lives.
        let into = slot.buf.lock().as_mut_ptr();
        // SAFETY: live I/O context and completion, NUL-terminated name, `into` valid for
        // `n` bytes for as long as `slot` lives (the callback holds a reference to it).
        let c = self.issue(Some(&slot), |c| unsafe {
            (api.aio_read)(self.conn.ioctx, oid.as_ptr(), c, into.cast(), n, within)
        })?;
        if !self.wait_slot(&slot, c, deadline) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("RADOS read of {n} bytes from {} gave no answer in {deadline:?}", oid.to_string_lossy()),
            ));
        }
        // SAFETY: the read completed (its callback ran); the completion is released once.
        let r = unsafe {
            let r = (api.aio_get_return_value)(c);
            (api.aio_release)(c);
            r
        };
        if r > 0 {
            let got = (r as usize).min(n);
            if let (Some(d), Some(b)) = (dst.get_mut(..got), slot.buf.lock().get(..got)) {
                d.copy_from_slice(b);
            }
        }
        Ok(r)
    }

    /// Makes a completion, whose callback sets `slot`'s flag when there is one, and issues
    /// the request `issue(completion)` with it (a librados call's return value). On an
    /// error nothing is left behind: no completion, no reference to `slot`.
    fn issue(
        &self,
        slot: Option<&std::sync::Arc<Slot>>,
        issue: impl FnOnce(CompletionT) -> c_int,
    ) -> io::Result<CompletionT> {
        let api = self.conn.api;
        let arg =
            slot.map_or(std::ptr::null_mut(), |s| std::sync::Arc::into_raw(s.clone()).cast_mut().cast::<c_void>());
        // The callback's reference to `slot`, taken back when no callback will run.
        let release_arg = || {
            if !arg.is_null() {
                // SAFETY: the reference handed over above, taken back once.
                drop(unsafe { std::sync::Arc::from_raw(arg.cast_const().cast::<Slot>()) });
            }
        };
        let mut c: CompletionT = std::ptr::null_mut();
        let callback: extern "C" fn(CompletionT, *mut c_void) = slot_done;
        let cb = if arg.is_null() { std::ptr::null_mut() } else { callback as *mut c_void };
        // SAFETY: `arg` is null or a live `Slot` reference for the callback; out-pointer to
        // a local.
        let r = unsafe { (api.aio_create_completion)(arg, cb, std::ptr::null_mut(), &mut c) };
        if r < 0 {
            release_arg();
            return Err(rados_err(r.into()));
        }
        let r = issue(c);
        if r < 0 {
            // SAFETY: the request was refused, so the callback will not run.
            unsafe { (api.aio_release)(c) };
            release_arg();
            return Err(rados_err(r.into()));
        }
        Ok(c)
    }

    /// Waits for the request of completion `c` until `deadline`; false when it gave up,
    /// having released `c` (librados frees it once the request ends, and the callback then
    /// drops its reference to `slot`).
    fn wait_slot(&self, slot: &Slot, c: CompletionT, deadline: std::time::Duration) -> bool {
        if slot.wait(deadline) {
            return true;
        }
        // SAFETY: a completion given up on, released once, never used again.
        unsafe { (self.conn.api.aio_release)(c) };
        false
    }

    /// Waits for the oldest queued write (until the device's deadline, if it has one) and
    /// records its failure.
    fn retire_oldest(&self, q: &mut Queue) {
        let Some(p) = q.pending.pop_front() else { return };
        q.bytes -= p.bytes;
        let api = self.conn.api;
        if let (Some(slot), Some(deadline)) = (&p.slot, self.conn.deadline) {
            let deadline = if q.gave_up { std::time::Duration::ZERO } else { deadline };
            if !self.wait_slot(slot, p.completion, deadline) {
                q.gave_up = true;
                if q.failed.is_none() {
                    q.failed = Some(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "a RADOS write of {} bytes to object {} gave no answer in {deadline:?}",
                            p.bytes, p.object
                        ),
                    ));
                }
                return;
            }
            // It answered: the cluster is back, later writes get their whole deadline.
            q.gave_up = false;
        }
        // SAFETY: a completion created by `write_at`, waited on and released once.
        let r = unsafe {
            (api.aio_wait_for_complete)(p.completion);
            let r = (api.aio_get_return_value)(p.completion);
            (api.aio_release)(p.completion);
            r
        };
        if r < 0 && q.failed.is_none() {
            q.failed = Some(rados_err(r.into()));
        }
    }
}

impl Storage for RadosStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let pieces = self.pieces(offset, buf.len())?;
        {
            // Read-your-writes: the queued writes up to the last one touching these objects
            // complete first (the queue is in order, so earlier ones go with them).
            let mut q = self.queue.lock();
            if let Some(last) = q.pending.iter().rposition(|p| pieces.iter().any(|&(o, ..)| o == p.object)) {
                for _ in 0..=last {
                    self.retire_oldest(&mut q);
                }
            }
        }
        for (object, within, at, n) in pieces {
            let oid = self.object_name(object)?;
            let dst = buf.get_mut(at..at + n).ok_or_else(|| io::Error::other("read piece out of range"))?;
            let r = match self.conn.deadline {
                Some(deadline) => self.read_with_deadline(&oid, dst, within, deadline)?,
                // SAFETY: live I/O context, NUL-terminated name, `dst` valid for `n` bytes.
                None => unsafe {
                    (self.conn.api.read)(self.conn.ioctx, oid.as_ptr(), dst.as_mut_ptr().cast(), n, within)
                },
            };
            let got = match r {
                r if r >= 0 => (r as usize).min(n),
                r if r == -libc::ENOENT => 0,
                r => return Err(rados_err(r.into())),
            };
            // Past an object's end (or an object never written) the device reads zeroes.
            if let Some(rest) = dst.get_mut(got..) {
                rest.fill(0);
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let api = self.conn.api;
        for (object, within, at, n) in self.pieces(offset, buf.len())? {
            let oid = self.object_name(object)?;
            let src = buf.get(at..at + n).ok_or_else(|| io::Error::other("write piece out of range"))?;
            let mut q = self.queue.lock();
            while q.pending.len() >= IN_FLIGHT_MAX || (!q.pending.is_empty() && q.bytes + n > IN_FLIGHT_BYTES_MAX) {
                self.retire_oldest(&mut q);
            }
            // SAFETY (both): live I/O context and completion; librados copies `src` before
            // returning.
            let write = |c: CompletionT| unsafe {
                (api.aio_write)(self.conn.ioctx, oid.as_ptr(), c, src.as_ptr().cast(), n, within)
            };
            let slot = self.conn.deadline.map(|_| Slot::new(0));
            let c = self.issue(slot.as_ref(), write)?;
            q.pending.push_back(Pending { object, bytes: n, completion: c, slot });
            q.bytes += n;
        }
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut q = self.queue.lock();
        while !q.pending.is_empty() {
            self.retire_oldest(&mut q);
        }
        match q.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn name(&self) -> String {
        self.url.to_string()
    }
}

impl Drop for RadosStorage {
    fn drop(&mut self) {
        let mut q = std::mem::take(&mut *self.queue.lock());
        while !q.pending.is_empty() {
            self.retire_oldest(&mut q);
        }
        if let (Some(cookie), Ok(name)) = (&self.cookie, cstr(LOCK_NAME)) {
            // SAFETY: live I/O context, NUL-terminated strings. A failure (the lock was
            // broken by a take-over) leaves nothing to undo.
            unsafe { (self.conn.api.unlock)(self.conn.ioctx, self.header.as_ptr(), name.as_ptr(), cookie.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_strictly() {
        let u = RadosUrl::parse(Path::new("rados://pool/vol-1.a")).expect("a url").expect("valid");
        assert_eq!((u.pool.as_str(), u.name.as_str()), ("pool", "vol-1.a"));
        assert_eq!(u.to_string(), "rados://pool/vol-1.a");
        assert!(RadosUrl::parse(Path::new("/dev/sda")).is_none());
        for bad in ["rados://", "rados://pool", "rados://pool/", "rados:///v", "rados://p/a/b", "rados://p/a b"] {
            assert!(RadosUrl::parse(Path::new(bad)).expect("a url").is_err(), "{bad}");
        }
    }
}
