//! One client connection: the fixed-newstyle handshake, then the transmission phase.
//!
//! Transmission runs a pool of worker threads per connection (this thread is one of them).
//! Each worker in turn takes the reader lock, parses one request header and reads any
//! write payload, releases the lock, runs the request against the backend and writes the
//! reply under the writer mutex, so replies may leave out of order (the spec allows it:
//! the client matches them by cookie). No request is handed between threads.
//!
//! Invariants:
//! - Requests in flight per connection are bounded twice: by count (one per worker) and by
//!   bytes ([`ConnectionLimits::inflight_bytes_max`]), so a client
//!   pipelining 32 MiB writes cannot make the server buffer without bound.
//! - A reply is written whole under the writer mutex: replies never interleave on the wire.
//! - A simple reply (writes, flushes, trims) may be queued, and is then sent by whichever
//!   thread holds the writer mutex, together with its own reply; a queued reply is never
//!   left behind (`ReplyWriter::send_queued`).
//! - A request the client already sent is either executed and answered, or the connection
//!   is closed; a client that disconnects mid-request only loses its own unanswered
//!   requests (its completed writes are in the shared backend, for every connection).
//! - Nothing the client sends can panic the server: protocol decisions are made by the
//!   pure functions in [`crate::proto`].
//! - Time is bounded where a client could stall the server: the handshake and each reply
//!   write ([`ConnectionLimits::handshake_timeout`], `reply_write_timeout`: a reply the
//!   client takes no byte of for that long breaks the connection). Once the server is
//!   stopping, a stalled reply is abandoned after `shutdown_reply_timeout`, so a client
//!   that stopped reading cannot hold up shutdown.

use crate::backend::Backend;
use crate::metrics::ServerMetrics;
use crate::proto::{self, Command, Disposition, ExportLimits};
use crate::stream::Stream;
use dedupvol_core::sync;
use parking_lot::{Condvar, Mutex};
use std::io::{self, BufReader, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Options after which a still-negotiating client is disconnected (it is spinning).
pub const OPTIONS_PER_CONNECTION_MAX: usize = 1024;
/// Default for [`ConnectionLimits::handshake_timeout`].
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`ConnectionLimits::reply_write_timeout`].
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`ConnectionLimits::shutdown_reply_timeout`].
pub const SHUTDOWN_REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// Options answered with an error on a connection refused at the connection limit before
/// it is closed (the spec asks a server to error options until the client gives up).
pub const REFUSED_OPTIONS_MAX: usize = 16;
/// Time a connection refused at the connection limit gets to read its error and leave.
pub const REFUSAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Failed or rejected requests logged per connection; the rest are only counted, so a
/// client retrying against a full volume cannot flood the log.
pub const ERROR_LOG_LINES_MAX: u64 = 16;
/// Socket read buffer: holds many pipelined request headers per system call.
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Per-connection bounds on the transmission phase.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Worker threads per connection (requests executed concurrently).
    pub workers: usize,
    /// Read and write payload bytes held in flight before the reader stops reading.
    pub inflight_bytes_max: u64,
    /// A client must finish negotiating within this time, or it is disconnected (so silent
    /// connections cannot hold `connections_max` slots). Transmission has no idle limit:
    /// an idle block device is normal.
    pub handshake_timeout: Duration,
    /// A reply write that makes no progress for this long (the client stopped reading)
    /// breaks the connection. Measured from the last byte the client took, however the
    /// reply is split into system calls.
    pub reply_write_timeout: Duration,
    /// Once the server is stopping, a reply write that makes no progress for this long
    /// (at most `reply_write_timeout`) is abandoned, so shutdown does not wait for a client
    /// that stopped reading. Clients still reading get their replies.
    pub shutdown_reply_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            workers: 4,
            inflight_bytes_max: 64 << 20,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            reply_write_timeout: REPLY_WRITE_TIMEOUT,
            shutdown_reply_timeout: SHUTDOWN_REPLY_TIMEOUT,
        }
    }
}

impl ConnectionLimits {
    /// How long a reply write may wait for the client to take a byte, now.
    fn stall_limit(&self, stopping: &AtomicBool) -> Duration {
        if stopping.load(Ordering::Relaxed) {
            self.shutdown_reply_timeout.min(self.reply_write_timeout)
        } else {
            self.reply_write_timeout
        }
    }
}

/// How an export is advertised: its name and policy.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// The export's name. The empty (default) name selects a server's first export.
    pub name: String,
    /// Optional human description (NBD_INFO_DESCRIPTION).
    pub description: Option<String>,
    /// Refuse writes with EPERM and advertise READ_ONLY.
    pub read_only: bool,
}

impl ExportConfig {
    /// Transmission flags advertised for this export.
    pub fn transmission_flags(&self) -> u16 {
        let mut f = proto::TFLAG_HAS_FLAGS
            | proto::TFLAG_SEND_FLUSH
            | proto::TFLAG_SEND_FUA
            | proto::TFLAG_SEND_TRIM
            | proto::TFLAG_SEND_WRITE_ZEROES
            // One backend shared by every connection: a flush covers all of them.
            | proto::TFLAG_CAN_MULTI_CONN;
        if self.read_only {
            f |= proto::TFLAG_READ_ONLY;
        }
        f
    }
}

/// One export of a server: how it is advertised, the disk behind it, and its own request
/// counters (so each volume's figures are its own when one server serves several).
#[derive(Clone)]
pub struct Export {
    /// Name and policy.
    pub config: ExportConfig,
    /// The disk.
    pub backend: Arc<dyn Backend>,
    /// Requests, bytes, errors and latency of this export's connections.
    pub metrics: Arc<ServerMetrics>,
}

impl Export {
    /// An export with fresh counters.
    pub fn new(config: ExportConfig, backend: Arc<dyn Backend>) -> Export {
        Export { config, backend, metrics: Arc::new(ServerMetrics::default()) }
    }
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export").field("config", &self.config).field("size", &self.backend.size()).finish()
    }
}

/// The export a client's name selects: the one of that name, or the first for the empty
/// (default) name.
pub fn select<'a>(exports: &'a [Export], requested: &str) -> Option<(usize, &'a Export)> {
    if requested.is_empty() {
        return exports.first().map(|e| (0, e));
    }
    exports.iter().enumerate().find(|(_, e)| e.config.name == requested)
}

/// Where a connection's TLS stands.
enum Tls<'a> {
    /// The server has no TLS.
    Off,
    /// Offered (or required) and not yet started.
    Offered(&'a crate::tls::TlsPolicy),
    /// The session runs inside TLS; the pump is joined when the connection ends.
    Active,
}

/// How a connection ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The client aborted the handshake or disconnected cleanly.
    Closed,
    /// The connection was dropped for a reason worth logging.
    Dropped(String),
}

fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    match r.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Runs one connection to completion. `stopping` makes negotiation refuse new sessions and
/// shortens the patience of reply writes (see [`ConnectionLimits::shutdown_reply_timeout`]).
///
/// With `tls`, the client may (or, when the policy requires it, must) upgrade with
/// `NBD_OPT_STARTTLS`; see [`crate::tls`].
pub fn serve_connection(
    stream: Stream,
    exports: &[Export],
    tls: Option<&crate::tls::TlsPolicy>,
    limits: &ConnectionLimits,
    stopping: &Arc<AtomicBool>,
) -> Outcome {
    let mut s = stream;
    if let Err(e) = s.set_read_timeout(Some(limits.handshake_timeout)) {
        return Outcome::Dropped(format!("setting the handshake timeout: {e}"));
    }
    let send = Sender { limits: limits.clone(), stopping: stopping.clone() };
    let mut pump = None;
    let negotiated = handshake(&mut s, &send, exports, tls, limits, stopping, &mut pump);
    let session = match negotiated {
        Ok(Some((session, i))) => match (s.set_read_timeout(None), exports.get(i)) {
            (Ok(()), Some(export)) => Ok((session, export)),
            (Err(e), _) => Err(Outcome::Dropped(format!("clearing the handshake timeout: {e}"))),
            (_, None) => Err(Outcome::Dropped("the negotiated export vanished".into())),
        },
        Ok(None) => Err(Outcome::Closed),
        // A client that hangs up mid-handshake (a probe such as a second server checking
        // whether the socket is live) is not worth a log line.
        Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
            Err(Outcome::Closed)
        }
        Err(e) => Err(Outcome::Dropped(format!("handshake: {e}"))),
    };
    let outcome = match session {
        Ok((session, export)) => {
            tracing::info!(
                "{} export {:?}{}",
                if pump.is_some() { "TLS session on" } else { "serving" },
                export.config.name,
                if session.structured { " (structured replies)" } else { "" }
            );
            export.metrics.connection_accepted();
            // Transmission shuts the stream down when it ends.
            let o = transmission(s, session, export, limits, send);
            export.metrics.connection_closed();
            o
        }
        Err(o) => {
            // Closed before the pump is joined: it ends when its end of the pair sees ours close.
            let _ = s.shutdown(Shutdown::Both);
            drop(s);
            o
        }
    };
    if let Some(p) = pump {
        // The connection's end of the pair is shut down by now, so the pump sees
        // end-of-file, sends its close_notify and ends.
        if p.join().is_err() {
            log!("a TLS pump thread panicked");
        }
    }
    outcome
}

/// Writes to a client within the stall limits of [`ConnectionLimits`].
#[derive(Clone)]
struct Sender {
    limits: ConnectionLimits,
    stopping: Arc<AtomicBool>,
}

impl Sender {
    fn send(&self, s: &Stream, parts: &[&[u8]]) -> io::Result<()> {
        s.send_all(parts, || self.limits.stall_limit(&self.stopping))
    }
    fn option_reply(&self, s: &Stream, option: u32, reply: u32, data: &[u8]) -> io::Result<()> {
        self.send(s, &[&proto::encode_option_reply(option, reply, data)])
    }
}

/// Answers a client the server has no room for: the greeting, then an error for every
/// option it sends (`NBD_REP_ERR_POLICY` with `message`: the spec lets a server refuse
/// options but not hang up unasked, and this way clients show the reason), until the client
/// aborts, asks for `NBD_OPT_EXPORT_NAME` (which cannot carry an error: closed), sends
/// [`REFUSED_OPTIONS_MAX`] options, or [`REFUSAL_TIMEOUT`] passes.
pub fn refuse_connection(stream: Stream, message: &str, stopping: &Arc<AtomicBool>) {
    let limits = ConnectionLimits {
        handshake_timeout: REFUSAL_TIMEOUT,
        reply_write_timeout: REFUSAL_TIMEOUT,
        ..ConnectionLimits::default()
    };
    let send = Sender { limits, stopping: stopping.clone() };
    let mut s = stream;
    let deadline = std::time::Instant::now() + REFUSAL_TIMEOUT;
    let _ = (|| -> io::Result<()> {
        s.set_read_timeout(Some(REFUSAL_TIMEOUT))?;
        send.send(&s, &[&proto::encode_greeting()])?;
        let mut flags = [0u8; 4];
        if !read_exact_or_eof(&mut s, &mut flags)? {
            return Ok(());
        }
        for _ in 0..REFUSED_OPTIONS_MAX {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            s.set_read_timeout(Some(left))?;
            let mut hdr = [0u8; proto::OPTION_HEADER_BYTES];
            if !read_exact_or_eof(&mut s, &mut hdr)? {
                break;
            }
            let Ok(h) = proto::parse_option_header(&hdr) else { break };
            io::copy(&mut (&mut s).take(u64::from(h.len)), &mut io::sink())?;
            match h.option {
                proto::OPT_EXPORT_NAME => break,
                proto::OPT_ABORT => {
                    send.option_reply(&s, h.option, proto::REP_ACK, &[])?;
                    break;
                }
                other => send.option_reply(&s, other, proto::REP_ERR_POLICY, message.as_bytes())?,
            }
        }
        Ok(())
    })();
    let _ = s.shutdown(Shutdown::Both);
}

/// What the handshake negotiated for the transmission phase.
#[derive(Debug, Clone, Copy)]
struct Session {
    /// Reads are answered with structured reply chunks.
    structured: bool,
    /// The client selected `base:allocation` (see `block_status`).
    allocation: bool,
}

/// Option haggling. Ok(Some((session, export index))): enter transmission; Ok(None): the
/// client left politely. A TLS upgrade replaces `s` with the plain end of the pump's
/// socket pair and puts the pump in `pump`.
fn handshake(
    s: &mut Stream,
    send: &Sender,
    exports: &[Export],
    tls: Option<&crate::tls::TlsPolicy>,
    limits: &ConnectionLimits,
    stopping: &AtomicBool,
    pump: &mut Option<std::thread::JoinHandle<()>>,
) -> io::Result<Option<(Session, usize)>> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let send_option_reply =
        |s: &mut Stream, option: u32, reply: u32, data: &[u8]| send.option_reply(s, option, reply, data);
    send.send(s, &[&proto::encode_greeting()])?;
    let mut flags = [0u8; 4];
    if !read_exact_or_eof(s, &mut flags)? {
        return Ok(None);
    }
    let client = proto::parse_client_flags(&flags).map_err(|e| invalid(e.to_string()))?;
    let mut tls_state = match tls {
        Some(p) => Tls::Offered(p),
        None => Tls::Off,
    };
    let mut session = Session { structured: false, allocation: false };
    for _ in 0..OPTIONS_PER_CONNECTION_MAX {
        let mut hdr = [0u8; proto::OPTION_HEADER_BYTES];
        if !read_exact_or_eof(s, &mut hdr)? {
            return Ok(None);
        }
        let h = proto::parse_option_header(&hdr).map_err(|e| invalid(e.to_string()))?;
        // Bounded by OPTION_DATA_BYTES_MAX in parse_option_header.
        let mut data = vec![0u8; h.len as usize];
        s.read_exact(&mut data)?;
        // A server that requires TLS answers every option but STARTTLS and ABORT with
        // TLS_REQD until the client upgrades (EXPORT_NAME, which cannot carry an error, by
        // closing).
        if matches!(tls_state, Tls::Offered(p) if p.required)
            && !matches!(h.option, proto::OPT_STARTTLS | proto::OPT_ABORT)
        {
            if h.option == proto::OPT_EXPORT_NAME {
                return Err(invalid("EXPORT_NAME before STARTTLS on a server that requires TLS".into()));
            }
            send_option_reply(s, h.option, proto::REP_ERR_TLS_REQD, b"this server requires TLS (STARTTLS)")?;
            continue;
        }
        match h.option {
            proto::OPT_STARTTLS => {
                let policy = match tls_state {
                    Tls::Off => {
                        send_option_reply(s, h.option, proto::REP_ERR_UNSUP, b"this server has no TLS configured")?;
                        continue;
                    }
                    Tls::Active => {
                        send_option_reply(s, h.option, proto::REP_ERR_INVALID, b"TLS is already active")?;
                        continue;
                    }
                    Tls::Offered(p) => p,
                };
                if !data.is_empty() {
                    send_option_reply(s, h.option, proto::REP_ERR_INVALID, b"STARTTLS takes no data")?;
                    continue;
                }
                send_option_reply(s, h.option, proto::REP_ACK, &[])?;
                let up = crate::tls::upgrade(s.try_clone()?, policy, limits.handshake_timeout)?;
                *pump = Some(up.pump);
                *s = up.stream;
                s.set_read_timeout(Some(limits.handshake_timeout))?;
                // Per the spec, what was negotiated before the upgrade is forgotten.
                session = Session { structured: false, allocation: false };
                tls_state = Tls::Active;
            }
            proto::OPT_EXPORT_NAME => {
                let name = proto::parse_name(&data).map_err(|e| invalid(e.to_string()))?;
                let Some((i, export)) = select(exports, &name).filter(|_| !stopping.load(Ordering::Relaxed)) else {
                    // EXPORT_NAME cannot carry an error: the spec says to close.
                    return Err(invalid(format!("unknown export {name:?} requested by EXPORT_NAME")));
                };
                let (size, tflags) = (export.backend.size(), export.config.transmission_flags());
                send.send(s, &[&proto::encode_export_name_reply(size, tflags, client.no_zeroes)])?;
                return Ok(Some((session, i)));
            }
            proto::OPT_ABORT => {
                // The client may already have closed; a failed ACK is not an error.
                let _ = send_option_reply(s, h.option, proto::REP_ACK, &[]);
                return Ok(None);
            }
            proto::OPT_LIST => {
                if !data.is_empty() {
                    send_option_reply(s, h.option, proto::REP_ERR_INVALID, b"LIST takes no data")?;
                    continue;
                }
                for e in exports {
                    send_option_reply(s, h.option, proto::REP_SERVER, &proto::encode_rep_server(&e.config.name))?;
                }
                send_option_reply(s, h.option, proto::REP_ACK, &[])?;
            }
            proto::OPT_INFO | proto::OPT_GO => {
                let req = match proto::parse_info_request(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        send_option_reply(s, h.option, proto::REP_ERR_INVALID, e.to_string().as_bytes())?;
                        continue;
                    }
                };
                let Some((i, export)) = select(exports, &req.name) else {
                    let names: Vec<&str> = exports.iter().map(|e| e.config.name.as_str()).collect();
                    let msg = format!("no export named {:?}; this server exports {names:?}", req.name);
                    send_option_reply(s, h.option, proto::REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                };
                let (size, tflags) = (export.backend.size(), export.config.transmission_flags());
                if stopping.load(Ordering::Relaxed) {
                    send_option_reply(s, h.option, proto::REP_ERR_SHUTDOWN, b"server is shutting down")?;
                    continue;
                }
                send_option_reply(s, h.option, proto::REP_INFO, &proto::encode_info_export(size, tflags))?;
                // Sent whether asked or not: min 1 / max 32 MiB are the spec's defaults,
                // so a client that ignores it loses nothing.
                send_option_reply(s, h.option, proto::REP_INFO, &proto::encode_info_block_size())?;
                if req.requests.contains(&proto::INFO_NAME) {
                    let d = proto::encode_info_string(proto::INFO_NAME, &export.config.name);
                    send_option_reply(s, h.option, proto::REP_INFO, &d)?;
                }
                if let (true, Some(desc)) =
                    (req.requests.contains(&proto::INFO_DESCRIPTION), &export.config.description)
                {
                    let d = proto::encode_info_string(proto::INFO_DESCRIPTION, desc);
                    send_option_reply(s, h.option, proto::REP_INFO, &d)?;
                }
                send_option_reply(s, h.option, proto::REP_ACK, &[])?;
                if h.option == proto::OPT_GO {
                    return Ok(Some((session, i)));
                }
            }
            proto::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    send_option_reply(s, h.option, proto::REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                    continue;
                }
                session.structured = true;
                send_option_reply(s, h.option, proto::REP_ACK, &[])?;
            }
            crate::block_status::OPT_LIST_META_CONTEXT | crate::block_status::OPT_SET_META_CONTEXT => {
                let n = crate::block_status::negotiate(h.option, &data, session.structured, |name| {
                    select(exports, name).is_some()
                });
                if let Some(selected) = n.allocation {
                    session.allocation = selected;
                }
                for (reply, d) in &n.replies {
                    send_option_reply(s, h.option, *reply, d)?;
                }
            }
            other => {
                // EXTENDED_HEADERS, ...: clients go on without them.
                let msg = format!("option {other} is not supported");
                send_option_reply(s, other, proto::REP_ERR_UNSUP, msg.as_bytes())?;
            }
        }
    }
    Err(invalid(format!("client sent more than {OPTIONS_PER_CONNECTION_MAX} options")))
}

/// Per-connection error log with a line budget; failures are also counted in the server's
/// metrics, all of them.
struct ErrorLog {
    count: std::sync::atomic::AtomicU64,
    metrics: Arc<ServerMetrics>,
}

impl ErrorLog {
    fn log(&self, what: std::fmt::Arguments<'_>) {
        let n = self.count.fetch_add(1, Ordering::Relaxed);
        if n < ERROR_LOG_LINES_MAX {
            log!("{what}");
        } else if n == ERROR_LOG_LINES_MAX {
            log!("further request errors on this connection are counted, not logged");
        }
    }
    fn finish(&self) {
        let n = self.count.load(Ordering::Relaxed);
        if n > ERROR_LOG_LINES_MAX {
            log!("{n} request errors on this connection in all");
        }
    }
}

/// A byte budget shared by the reader (acquire) and the workers (release).
struct Budget {
    used: Mutex<u64>,
    freed: Condvar,
    max: u64,
}

impl Budget {
    fn acquire(&self, n: u64) {
        let mut used = self.used.lock();
        // A single request larger than the budget still runs, alone, so nothing deadlocks.
        while *used > 0 && *used + n > self.max {
            self.freed.wait(&mut used);
        }
        *used += n;
    }
    fn release(&self, n: u64) {
        let mut used = self.used.lock();
        *used = used.saturating_sub(n);
        self.freed.notify_all();
    }
}

struct Job {
    cookie: u64,
    cmd: Command,
    /// Bytes of the worker's payload buffer this request's write payload fills.
    payload_len: usize,
    cost_bytes: u64,
}

/// Writes replies; shared by the reader (for rejects) and the workers.
struct ReplyWriter {
    /// A reply's send holds it for the whole copy into the socket: its waiters sleep
    /// (`sync::Mutex`), they do not yield the CPU in a loop behind it.
    stream: sync::Mutex<Stream>,
    /// Simple replies waiting for the stream (`status`): whoever holds the stream sends
    /// them with its own reply, in one vectored write.
    queued: Mutex<Vec<u8>>,
    send: Sender,
    broken: AtomicBool,
    /// Why the first failed reply failed (for the connection's log line).
    broken_why: Mutex<Option<String>>,
    /// Structured replies were negotiated: reads are answered with chunks.
    structured: bool,
}

impl ReplyWriter {
    /// Writes `head` then `body` as one message, under the lock.
    fn write(&self, head: &[u8], body: &[u8]) {
        self.write_parts(&[head, body]);
    }

    /// Writes `parts` back to back as one message (one vectored write), under the lock,
    /// with any queued simple replies after them; then sends what was queued meanwhile.
    fn write_parts(&self, parts: &[&[u8]]) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        {
            let s = self.stream.lock();
            // Checked again under the lock: the writer before us may have just broken it.
            if self.broken.load(Ordering::Relaxed) {
                return;
            }
            let queued = std::mem::take(&mut *self.queued.lock());
            let r = if queued.is_empty() {
                self.send.send(&s, parts)
            } else if parts.len() < SEND_PARTS_PER_REPLY {
                let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
                all.extend_from_slice(parts);
                all.push(&queued);
                self.send.send(&s, &all)
            } else {
                self.send.send(&s, parts).and_then(|()| self.send.send(&s, &[&queued]))
            };
            if let Err(e) = r {
                self.break_stream(&s, &e);
            }
        }
        self.send_queued();
    }

    /// The client is gone, stopped reading, or the stream is out of sync: stop the reader
    /// too (shutdown wakes it with end-of-file). Stream lock held.
    fn break_stream(&self, s: &Stream, e: &io::Error) {
        self.broken_why.lock().get_or_insert_with(|| e.to_string());
        self.broken.store(true, Ordering::Relaxed);
        let _ = s.shutdown(Shutdown::Both);
    }

    /// The reply to anything but a read: a simple reply (allowed in either mode), queued
    /// and sent by this thread unless another one holds the stream. Why: every send wakes
    /// the client, and on a small machine the woken client often preempts the sender while
    /// it holds the stream, so the other workers' replies queued behind it; now a sender
    /// takes every reply finished meanwhile along, in one write and one wake-up.
    fn status(&self, error: u32, cookie: u64) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        self.queued.lock().extend_from_slice(&proto::encode_simple_reply(error, cookie));
        self.send_queued();
    }

    /// Sends the queued simple replies unless another thread holds the stream. No reply is
    /// left behind: a thread queues before it tries the stream, and a holder looks at the
    /// queue after letting the stream go, so of the two at least one sees every reply.
    fn send_queued(&self) {
        loop {
            if self.broken.load(Ordering::Relaxed) || self.queued.lock().is_empty() {
                return;
            }
            let Some(s) = self.stream.try_lock() else { return };
            if self.broken.load(Ordering::Relaxed) {
                return;
            }
            let queued = std::mem::take(&mut *self.queued.lock());
            if !queued.is_empty() {
                if let Err(e) = self.send.send(&s, &[&queued]) {
                    self.break_stream(&s, &e);
                }
            }
        }
    }

    /// A successful read of `data` at `offset`.
    fn read_ok(&self, cookie: u64, offset: u64, data: &[u8]) {
        self.read_ok_pieces(cookie, offset, data.len(), vec![&[], data]);
    }

    /// A successful read whose data is `parts[i]` where present, else block `i` of `buf`
    /// (see `Backend::read_shared`): sent in place, consecutive pieces of `buf` as one.
    fn read_ok_shared(&self, cookie: u64, offset: u64, buf: &[u8], parts: &[Option<dedupvol_core::block::Block>]) {
        if parts.iter().all(Option::is_none) {
            return self.read_ok(cookie, offset, buf);
        }
        let mut pieces: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        pieces.push(&[]); // the header's place
        let mut from = None;
        for (i, part) in parts.iter().enumerate() {
            match part {
                Some(b) => {
                    if let Some(f) = from.take() {
                        pieces.push(buf.get(f * BLOCK_BYTES..i * BLOCK_BYTES).unwrap_or_default());
                    }
                    pieces.push(b);
                }
                None => {
                    from.get_or_insert(i);
                }
            }
        }
        if let Some(f) = from {
            pieces.push(buf.get(f * BLOCK_BYTES..parts.len() * BLOCK_BYTES).unwrap_or_default());
        }
        self.read_ok_pieces(cookie, offset, buf.len(), pieces);
    }

    /// Sends a successful read of `len` bytes whose data is `pieces[1..]` back to back
    /// (`pieces[0]` is the header's place): a simple reply, or in structured mode a data
    /// chunk, a hole chunk for all-zero data, or an empty final chunk for no data.
    fn read_ok_pieces(&self, cookie: u64, offset: u64, len: usize, pieces: Vec<&[u8]>) {
        let len = len as u32;
        let (simple, chunk);
        let head: &[u8] = if !self.structured {
            simple = proto::encode_simple_reply(0, cookie);
            &simple
        } else if len == 0 {
            return self
                .write(&proto::encode_chunk_header(proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_NONE, cookie, 0), &[]);
        } else if pieces.iter().all(|p| p.iter().all(|&b| b == 0)) {
            // Thin volumes read mostly zeros: 32 bytes instead of the data.
            return self.write(&proto::encode_hole_chunk(cookie, offset, len), &[]);
        } else {
            chunk = proto::encode_data_chunk_prefix(cookie, offset, len);
            &chunk
        };
        // Rebound (the vector is covariant) so it may hold the local header.
        let mut pieces: Vec<&[u8]> = pieces;
        if let Some(h) = pieces.first_mut() {
            *h = head;
        }
        self.write_parts(&pieces);
    }

    /// A failed read: no data follows.
    fn read_err(&self, cookie: u64, error: u32, message: &str) {
        if self.structured {
            self.write(&proto::encode_error_chunk(cookie, error, message), &[]);
        } else {
            self.status(error, cookie);
        }
    }
}

/// Parts one reply may take with the queued simple replies added as one more (the stream
/// takes at most `1 + 1024`).
const SEND_PARTS_PER_REPLY: usize = 1024;

/// The block size of shared read parts (`Backend::read_shared`).
const BLOCK_BYTES: usize = 4096;

/// Reads up to this size reuse their worker's buffer; larger ones get a buffer of their own
/// (a worker never keeps more than this between requests).
const READ_SCRATCH_BYTES_MAX: usize = 4 << 20;

/// Write payloads up to this size are read into their worker's buffer, kept between
/// requests (as `READ_SCRATCH_BYTES_MAX` for reads): a fresh zeroed buffer per write put
/// `calloc` alone at 4 % of the server's CPU under a 70/30 mix of 8–128 KiB requests, with
/// page faults and page clearing beneath it. A larger payload gets a buffer of its own,
/// dropped after its request.
const WRITE_PAYLOAD_BYTES_MAX: usize = 4 << 20;

/// Runs one request. `scratch` is the worker's read buffer, kept between requests so a
/// read neither allocates (a fresh 1 MiB buffer is a fresh mapping: 256 page faults) nor
/// zeroes memory the backend overwrites anyway. A read reply sends only bytes the backend
/// wrote for this request: on success it fills the whole range, on error nothing is sent.
fn execute(
    backend: &dyn Backend,
    job: &Job,
    payload: &[u8],
    writer: &ReplyWriter,
    log: &ErrorLog,
    scratch: &mut Vec<u8>,
    parts: &mut Vec<Option<dedupvol_core::block::Block>>,
) {
    let report = |e: &crate::backend::BackendError| {
        log.metrics.failed(&job.cmd, e.kind);
        log.log(format_args!("request {:#x} failed: {e}", job.cookie));
        proto::nbd_error_from_errno(e.errno)
    };
    let status =
        |r: Result<(), crate::backend::BackendError>| writer.status(r.err().map_or(0, |e| report(&e)), job.cookie);
    // Zero-length requests touch nothing; the engine need not define them.
    let fua_only = |fua: bool| if fua { backend.flush() } else { Ok(()) };
    match job.cmd {
        Command::Read { offset, len: 0 } => writer.read_ok(job.cookie, offset, &[]),
        Command::Write { len: 0, fua, .. }
        | Command::Trim { len: 0, fua, .. }
        | Command::WriteZeroes { len: 0, fua, .. } => status(fua_only(fua)),
        Command::Read { offset, len } => {
            let len = len as usize;
            let mut own = Vec::new();
            let buf = if len <= READ_SCRATCH_BYTES_MAX {
                if scratch.len() < len {
                    scratch.resize(len, 0);
                }
                scratch.get_mut(..len).unwrap_or_default()
            } else {
                own.resize(len, 0);
                own.as_mut_slice()
            };
            let shared = len <= READ_SCRATCH_BYTES_MAX;
            let r = if shared { backend.read_shared(offset, buf, parts) } else { backend.read(offset, buf) };
            match r {
                Ok(()) if shared => writer.read_ok_shared(job.cookie, offset, buf, parts),
                Ok(()) => writer.read_ok(job.cookie, offset, buf),
                // No data follows an error, in either reply mode.
                Err(e) => writer.read_err(job.cookie, report(&e), &e.message),
            }
            // Sent or failed: the worker must not keep cache blocks alive (and their memory
            // held) after the cache evicts them.
            parts.clear();
        }
        Command::Write { offset, fua, .. } => {
            status(backend.write(offset, payload, fua));
        }
        Command::Flush => {
            status(backend.flush());
        }
        Command::Trim { offset, len, fua } => {
            // The engine's discard has no FUA of its own; a flush after it gives the same.
            status(backend.trim(offset, u64::from(len)).and_then(|()| fua_only(fua)));
        }
        Command::WriteZeroes { offset, len, fua } => {
            status(backend.write_zeroes(offset, u64::from(len), fua));
        }
        Command::BlockStatus { offset, len, req_one } => {
            match crate::block_status::reply(backend, job.cookie, offset, len, req_one) {
                Ok(chunk) => writer.write(&chunk, &[]),
                Err(e) => writer.read_err(job.cookie, report(&e), &e.message),
            }
        }
    }
}

/// The request side of a connection, shared by its workers: whoever holds it reads the
/// next request; `ended` records why the connection stopped reading.
struct RequestReader {
    reader: BufReader<Stream>,
    ended: Option<Outcome>,
}

/// What one turn at the socket produced.
enum Next {
    /// A request to execute.
    Job(Job),
    /// A request answered without the backend (rejected); read the next.
    Answered,
    /// The connection stops reading.
    End(Outcome),
}

/// Reads the next request (header, then any write payload). The byte budget is taken
/// before the payload is read, so requests in flight stay within it.
fn next_request(
    r: &mut BufReader<Stream>,
    lim: &ExportLimits,
    budget: &Budget,
    writer: &ReplyWriter,
    log: &ErrorLog,
    payload: &mut Vec<u8>,
) -> Next {
    let mut hdr = [0u8; proto::REQUEST_HEADER_BYTES];
    match read_exact_or_eof(r, &mut hdr) {
        Ok(true) => {}
        Ok(false) => return Next::End(Outcome::Closed),
        Err(e) => return Next::End(Outcome::Dropped(format!("reading request: {e}"))),
    }
    let req = match proto::parse_request(&hdr) {
        Ok(req) => req,
        Err(e) => return Next::End(Outcome::Dropped(format!("bad request: {e}"))),
    };
    match proto::classify_request(&req, lim) {
        Disposition::Disconnect => Next::End(Outcome::Closed),
        Disposition::Close(why) => Next::End(Outcome::Dropped(why)),
        Disposition::Reject { error, skip, reason } => {
            log.metrics.rejected();
            log.log(format_args!("rejecting request {:#x}: {reason}", req.cookie));
            match io::copy(&mut r.take(u64::from(skip)), &mut io::sink()) {
                Ok(n) if n == u64::from(skip) && req.kind == proto::CMD_READ => {
                    writer.read_err(req.cookie, error, &reason);
                    Next::Answered
                }
                Ok(n) if n == u64::from(skip) => {
                    writer.status(error, req.cookie);
                    Next::Answered
                }
                Ok(_) => Next::End(Outcome::Closed),
                Err(e) => Next::End(Outcome::Dropped(format!("reading payload: {e}"))),
            }
        }
        Disposition::Execute(cmd) => {
            let (cost_bytes, payload_len) = match cmd {
                Command::Read { len, .. } => (u64::from(len), 0),
                Command::Write { len, .. } => (u64::from(len), len as usize),
                _ => (0, 0),
            };
            budget.acquire(cost_bytes);
            if payload_len > WRITE_PAYLOAD_BYTES_MAX {
                *payload = vec![0u8; payload_len];
            } else if payload.len() < payload_len {
                // Grown once to the largest payload seen; never shrunk below it, so a
                // buffer already that large is not zeroed again (the read overwrites it).
                payload.resize(payload_len, 0);
            }
            let Some(into) = payload.get_mut(..payload_len) else {
                budget.release(cost_bytes);
                return Next::End(Outcome::Dropped("write payload buffer shorter than its request".into()));
            };
            match read_exact_or_eof(r, into) {
                Ok(true) => Next::Job(Job { cookie: req.cookie, cmd, payload_len, cost_bytes }),
                // The client left mid-payload: the partial write is never applied.
                Ok(false) => {
                    budget.release(cost_bytes);
                    Next::End(Outcome::Closed)
                }
                Err(e) => {
                    budget.release(cost_bytes);
                    Next::End(Outcome::Dropped(format!("reading write payload: {e}")))
                }
            }
        }
    }
}

/// The transmission phase. Every worker reads its own request from the socket (one at a
/// time, under the reader lock), executes it and writes its reply: no hand-off between a
/// reader thread and a worker, so a request costs no thread wake-up (with a reader thread
/// and a queue, two context switches per 4 KiB read were most of the server's time). Up
/// to `workers` requests are in flight per connection, within the byte budget.
fn transmission(stream: Stream, session: Session, export: &Export, limits: &ConnectionLimits, send: Sender) -> Outcome {
    let backend = export.backend.clone();
    let metrics = export.metrics.clone();
    let write_half = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => return Outcome::Dropped(format!("cannot clone socket: {e}")),
    };
    let writer = Arc::new(ReplyWriter {
        stream: sync::Mutex::new(write_half),
        queued: Mutex::new(Vec::new()),
        send,
        broken: AtomicBool::new(false),
        broken_why: Mutex::new(None),
        structured: session.structured,
    });
    let budget = Arc::new(Budget { used: Mutex::new(0), freed: Condvar::new(), max: limits.inflight_bytes_max });
    let log = Arc::new(ErrorLog { count: std::sync::atomic::AtomicU64::new(0), metrics });
    let lim = ExportLimits {
        size: backend.size(),
        read_only: export.config.read_only,
        block_status: session.structured && session.allocation,
    };
    let requests = Arc::new(sync::Mutex::new(RequestReader {
        reader: BufReader::with_capacity(READ_BUFFER_BYTES, stream),
        ended: None,
    }));
    let work = {
        let (requests, writer, budget, backend, log) =
            (requests.clone(), writer.clone(), budget.clone(), backend.clone(), log.clone());
        move || {
            let mut scratch = Vec::new();
            let mut parts = Vec::new();
            let mut payload = Vec::new();
            loop {
                let job = {
                    let mut rq = requests.lock();
                    if rq.ended.is_some() {
                        break;
                    }
                    if writer.broken.load(Ordering::Relaxed) {
                        rq.ended = Some(Outcome::Dropped("reply could not be written".into()));
                        break;
                    }
                    match next_request(&mut rq.reader, &lim, &budget, &writer, &log, &mut payload) {
                        Next::Job(job) => job,
                        Next::Answered => continue,
                        Next::End(outcome) => {
                            rq.ended = Some(outcome);
                            break;
                        }
                    }
                };
                // An engine bug must cost one request (EIO), not the connection's accounting.
                let started = std::time::Instant::now();
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // `next_request` sized the buffer to the payload it read into it.
                    match payload.get(..job.payload_len) {
                        Some(body) => execute(backend.as_ref(), &job, body, &writer, &log, &mut scratch, &mut parts),
                        None => writer.status(proto::NBD_EIO, job.cookie),
                    }
                }));
                if payload.len() > WRITE_PAYLOAD_BYTES_MAX {
                    payload = Vec::new();
                }
                log.metrics.request(&job.cmd, started.elapsed());
                if ran.is_err() {
                    log.log(format_args!("request {:#x} panicked in the backend; answering EIO", job.cookie));
                    match job.cmd {
                        Command::Read { .. } => writer.read_err(job.cookie, proto::NBD_EIO, "internal error"),
                        _ => writer.status(proto::NBD_EIO, job.cookie),
                    }
                }
                budget.release(job.cost_bytes);
            }
        }
    };
    let mut workers = Vec::with_capacity(limits.workers);
    for i in 1..limits.workers.max(1) {
        match std::thread::Builder::new().name(format!("nbd-worker-{i}")).spawn(work.clone()) {
            Ok(h) => workers.push(h),
            // Fewer workers only means fewer requests in flight.
            Err(e) => {
                log!("cannot start worker thread {i}: {e}");
                break;
            }
        }
    }
    // This thread is worker 0. Every worker leaves once the reader has ended, after
    // answering the request it holds: every request already read is answered.
    work();
    for w in workers {
        if w.join().is_err() {
            log!("a worker thread panicked");
        }
    }
    let _ = writer.stream.lock().shutdown(Shutdown::Both);
    log.finish();
    let outcome = requests.lock().ended.take().unwrap_or(Outcome::Closed);
    // A broken reply ends the reader with end-of-file or a read error; name the real cause.
    let why = writer.broken_why.lock().take();
    match why {
        Some(why) => Outcome::Dropped(format!("writing a reply: {why}")),
        None => outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// A simple reply queued while another thread's reply holds the stream (its send
    /// blocked on a full socket) is sent by that thread once it lets the stream go.
    #[test]
    fn a_reply_queued_behind_a_blocked_send_is_sent_when_it_ends() {
        let (ours, mut client) = UnixStream::pair().expect("socketpair");
        let writer = Arc::new(ReplyWriter {
            stream: sync::Mutex::new(Stream::Unix(ours)),
            queued: Mutex::new(Vec::new()),
            send: Sender { limits: ConnectionLimits::default(), stopping: Arc::new(AtomicBool::new(false)) },
            broken: AtomicBool::new(false),
            broken_why: Mutex::new(None),
            structured: false,
        });
        // Far more than a socket buffer: the send blocks until the client reads.
        let big = vec![0xA5u8; 8 << 20];
        let sending = {
            let (w, big) = (writer.clone(), big.clone());
            std::thread::spawn(move || w.write_parts(&[&big]))
        };
        // Wait until the big send holds the stream, then queue a reply behind it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while writer.stream.try_lock().is_some() {
            assert!(std::time::Instant::now() < deadline, "the big send never took the stream");
            std::thread::sleep(Duration::from_millis(1));
        }
        writer.status(0, 0x77);
        client.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut got = vec![0u8; big.len()];
        client.read_exact(&mut got).expect("the big reply");
        assert!(got == big);
        let mut reply = [0u8; proto::SIMPLE_REPLY_BYTES];
        client.read_exact(&mut reply).expect("the queued reply was left behind");
        assert_eq!(reply, proto::encode_simple_reply(0, 0x77));
        sending.join().expect("sender");
    }
}
