//! The accept loop: listens, admits up to `connections_max` clients, and shuts down cleanly.
//!
//! Shutdown (SIGINT/SIGTERM/SIGHUP, or [`StopHandle::stop`]): stop accepting; shut down the
//! read half of every connection so its reader sees end-of-file; each connection's workers
//! finish and answer the requests already accepted (a reply the client takes no byte of for
//! [`ConnectionLimits::shutdown_reply_timeout`] is abandoned); every thread is joined.
//! [`Server::run`] then returns, and the caller flushes and closes the backend (for a
//! [`dedupvol_core::Volume`], `close()` does both).
//!
//! Invariants:
//! - When `run` returns, no thread the server started is alive and the server holds no
//!   reference to the backend, so the caller can take it back out of its `Arc`.
//! - At most `connections_max` connections are served at once. An extra client is told why
//!   (`NBD_REP_ERR_POLICY` "server at its connection limit (N)" to each option, see
//!   [`refuse_connection`]) and closed; at most `REFUSALS_IN_FLIGHT_MAX` such answers run
//!   at once, beyond that extra clients are closed at accept.

use crate::backend::Backend;
use crate::connection::{refuse_connection, serve_connection, ConnectionLimits, Export, Outcome};
use crate::metrics::ServerMetrics;
use crate::stream::{ListenAddr, Listener, Stream};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Clients over the connection limit being told so at once; more are closed without a word
/// (a flood of connections must not become a flood of threads).
const REFUSALS_IN_FLIGHT_MAX: usize = 4;
/// Most exports one server serves (each is one volume held open).
pub const EXPORTS_MAX: usize = 256;

/// Everything the server needs besides its exports.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most clients served at once.
    pub connections_max: usize,
    /// Per-connection bounds.
    pub limits: ConnectionLimits,
    /// TLS offered (or required) to clients; `None`: plain connections only.
    pub tls: Option<crate::tls::TlsPolicy>,
}

/// Checks a server's export list: at least one export, at most [`EXPORTS_MAX`], names
/// unique and within the protocol's bound.
pub fn validate_exports(exports: &[Export]) -> io::Result<()> {
    let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
    if exports.is_empty() {
        return bad("a server needs at least one export".into());
    }
    if exports.len() > EXPORTS_MAX {
        return bad(format!("{} exports; a server serves at most {EXPORTS_MAX}", exports.len()));
    }
    let mut seen = std::collections::HashSet::new();
    for e in exports {
        let name = &e.config.name;
        if name.len() > crate::proto::NAME_BYTES_MAX {
            return bad(format!("export name {name:?} is longer than {} bytes", crate::proto::NAME_BYTES_MAX));
        }
        if !seen.insert(name.as_str()) {
            return bad(format!("two exports are named {name:?}"));
        }
    }
    Ok(())
}

/// Stops a running server from another thread (or a test).
#[derive(Debug)]
pub struct StopHandle(UnixStream);

impl StopHandle {
    /// Asks the server to stop; returns at once.
    pub fn stop(&self) -> io::Result<()> {
        (&self.0).write_all(&[1])
    }
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RunSummary {
    /// Connections accepted and served.
    pub connections_served: u64,
    /// Connections refused because `connections_max` were open.
    pub connections_refused: u64,
}

/// A bound NBD server.
pub struct Server {
    listener: Listener,
    config: ServerConfig,
    stop_read: UnixStream,
    stop_write: UnixStream,
    metrics: Arc<ServerMetrics>,
}

impl Server {
    /// Binds the listening socket. Clients that connect before [`Server::run`] wait in the
    /// kernel's backlog, so a readiness line printed after `bind` is truthful.
    pub fn bind(addr: &ListenAddr, config: ServerConfig) -> io::Result<Server> {
        let listener = Listener::bind(addr)?;
        let (stop_read, stop_write) = UnixStream::pair()?;
        stop_read.set_nonblocking(true)?;
        stop_write.set_nonblocking(true)?;
        Ok(Server { listener, config, stop_read, stop_write, metrics: Arc::new(ServerMetrics::default()) })
    }

    /// The bound address (`127.0.0.1:10809`, or `unix:/path`).
    pub fn display_addr(&self) -> String {
        self.listener.display_addr()
    }

    /// The server's live counters, for an admin socket or a metrics endpoint; they keep
    /// counting until the server stops. Refused connections are counted here; requests and
    /// connections by export, in each [`Export`]'s own counters ([`Server::run`] gives its
    /// single export these).
    pub fn metrics(&self) -> Arc<ServerMetrics> {
        self.metrics.clone()
    }

    /// A handle that stops [`Server::run`].
    pub fn stop_handle(&self) -> io::Result<StopHandle> {
        Ok(StopHandle(self.stop_write.try_clone()?))
    }

    /// Makes SIGINT, SIGTERM and SIGHUP stop the server; a second signal exits at once (for
    /// a shutdown stuck on a dead device). SIGHUP included because its default action kills
    /// the process without closing the volume (a hung-up terminal, a `nohup`-less session).
    /// A signal the process was started with ignored (`nohup` ignores SIGHUP) stays ignored:
    /// whoever started it asked for the server to outlive that signal.
    pub fn stop_on_signals(&self) -> io::Result<()> {
        let second = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
            if signal_ignored(sig)? {
                continue;
            }
            signal_hook::flag::register_conditional_shutdown(sig, 130, second.clone())?;
            signal_hook::flag::register(sig, second.clone())?;
            signal_hook::low_level::pipe::register(sig, self.stop_write.try_clone()?)?;
        }
        Ok(())
    }

    /// Serves one export until stopped (see [`Server::run_exports`]).
    pub fn run(self, export: crate::connection::ExportConfig, backend: Arc<dyn Backend>) -> io::Result<RunSummary> {
        let export = Export { config: export, backend, metrics: self.metrics.clone() };
        self.run_exports(vec![export])
    }

    /// Serves `exports` until stopped. See the module docs for the shutdown sequence.
    pub fn run_exports(self, exports: Vec<Export>) -> io::Result<RunSummary> {
        validate_exports(&exports)?;
        let exports: Arc<[Export]> = exports.into();
        let stopping = Arc::new(AtomicBool::new(false));
        let live: Arc<Mutex<HashMap<u64, Stream>>> = Arc::new(Mutex::new(HashMap::new()));
        let refusing: Arc<Mutex<HashMap<u64, Stream>>> = Arc::new(Mutex::new(HashMap::new()));
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let mut summary = RunSummary::default();
        let mut next_id: u64 = 0;
        let result = loop {
            match wait_readable(self.listener.as_raw_fd(), self.stop_read.as_raw_fd()) {
                Ok(Ready::Stop) => break Ok(()),
                Ok(Ready::Listener) => {}
                Err(e) => break Err(e),
            }
            let stream = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => continue,
                // ECONNABORTED and friends concern one client, not the server.
                Err(e) => {
                    log!("accept failed: {e}");
                    continue;
                }
            };
            threads.retain(|t| !t.is_finished());
            let id = next_id;
            next_id += 1;
            if live.lock().len() >= self.config.connections_max {
                log!(
                    "refusing {}: {} connections already open (--connections-max)",
                    stream.peer(),
                    self.config.connections_max
                );
                summary.connections_refused += 1;
                self.metrics.connection_refused();
                if let Some(t) = self.spawn_refusal(id, stream, &refusing, &stopping) {
                    threads.push(t);
                }
                continue;
            }
            let shutdown_handle = match stream.try_clone() {
                Ok(h) => h,
                Err(e) => {
                    log!("cannot track connection: {e}");
                    continue;
                }
            };
            live.lock().insert(id, shutdown_handle);
            // Connections are counted by the export they select (see `serve_connection`).
            let (exports, tls, limits, stopping, live2) =
                (exports.clone(), self.config.tls.clone(), self.config.limits.clone(), stopping.clone(), live.clone());
            let peer = stream.peer();
            tracing::info!("connection {id} from {peer} accepted");
            let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
                let outcome = serve_connection(stream, &exports, tls.as_ref(), &limits, &stopping);
                match outcome {
                    Outcome::Dropped(why) => log!("connection {id} from {peer} closed: {why}"),
                    Outcome::Closed => tracing::info!("connection {id} from {peer} closed"),
                }
                live2.lock().remove(&id);
            });
            match spawned {
                Ok(t) => {
                    threads.push(t);
                    summary.connections_served += 1;
                }
                Err(e) => {
                    log!("cannot start a connection thread: {e}");
                    live.lock().remove(&id);
                }
            }
        };
        // Stop: refuse new sessions, wake every reader, let in-flight requests finish.
        stopping.store(true, Ordering::Relaxed);
        for s in live.lock().values().chain(refusing.lock().values()) {
            let _ = s.shutdown(Shutdown::Read);
        }
        for t in threads {
            if t.join().is_err() {
                log!("a connection thread panicked");
            }
        }
        let mut drain = [0u8; 64];
        let _ = (&self.stop_read).read(&mut drain);
        result.map(|()| summary)
    }

    /// Starts telling a client over the connection limit why it is refused; `None` when
    /// too many refusals are already running (the stream is then just closed).
    fn spawn_refusal(
        &self,
        id: u64,
        stream: Stream,
        refusing: &Arc<Mutex<HashMap<u64, Stream>>>,
        stopping: &Arc<AtomicBool>,
    ) -> Option<JoinHandle<()>> {
        let handle = stream.try_clone().ok()?;
        {
            let mut r = refusing.lock();
            if r.len() >= REFUSALS_IN_FLIGHT_MAX {
                return None;
            }
            r.insert(id, handle);
        }
        let message = format!("server at its connection limit ({})", self.config.connections_max);
        let (refusing2, stopping) = (refusing.clone(), stopping.clone());
        let spawned = std::thread::Builder::new().name(format!("nbd-refuse-{id}")).spawn(move || {
            refuse_connection(stream, &message, &stopping);
            refusing2.lock().remove(&id);
        });
        match spawned {
            Ok(t) => Some(t),
            Err(_) => {
                refusing.lock().remove(&id);
                None
            }
        }
    }
}

/// True when `sig`'s disposition is SIG_IGN (inherited from whoever started us).
fn signal_ignored(sig: i32) -> io::Result<bool> {
    // SAFETY: sigaction with a null new action only reads the current one into `old`,
    // a zeroed (valid) sigaction owned by this frame.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(old.sa_sigaction == libc::SIG_IGN)
}

/// What `wait_readable` saw first.
pub enum Ready {
    /// A client is waiting on the listener.
    Listener,
    /// The stop socket is readable or closed.
    Stop,
}

/// Waits until a client is pending on `listener` or `stop` is readable or closed (stop
/// wins when both are); interrupted polls are retried.
pub fn wait_readable(listener: i32, stop: i32) -> io::Result<Ready> {
    loop {
        let mut fds = [
            libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Ready::Stop);
        }
        if fds[0].revents != 0 {
            return Ok(Ready::Listener);
        }
    }
}
