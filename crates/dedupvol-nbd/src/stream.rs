//! TCP and Unix-domain sockets behind one type, so the server code is written once.
//!
//! Invariants:
//! - A Unix socket path that a live server answers on is never taken over: binding it
//!   fails; only a stale socket file (nobody accepts on it) is replaced.
//! - A listener removes its socket file on drop only while that file is still the one it
//!   bound (same device and inode), so a server never deletes another server's socket.
//! - [`Stream::send_all`] never blocks for longer than its stall limit without the peer
//!   taking bytes, and never raises SIGPIPE.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Buffers one [`Stream::send_all`] call may gather: a reply's header and its payload, in
/// up to one piece per 4 KiB block of a 4 MiB read (shared cached blocks are sent in place).
const SEND_PARTS_MAX: usize = 1 + 1024;
/// Buffers per `sendmsg` call (Linux's IOV_MAX); a reply of more parts takes several calls.
const IOVECS_PER_CALL: usize = 1024;
/// Longest single wait in [`Stream::send_all`] before it re-reads its stall limit, so a
/// limit lowered from another thread (server shutdown) takes effect promptly.
const SEND_POLL_SLICE: Duration = Duration::from_millis(100);

/// A connected client socket.
#[derive(Debug)]
pub enum Stream {
    /// TCP.
    Tcp(TcpStream),
    /// Unix-domain socket.
    Unix(UnixStream),
}

impl Stream {
    /// A second handle to the same socket (for the reply writer, or for shutdown).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }
    /// Shuts down one or both directions; wakes a thread blocked reading.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        }
    }
    /// Switches between blocking and non-blocking I/O.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
        }
    }
    /// Bounds how long one read may wait (`None`: forever).
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }
    /// Bounds how long one write may wait for the peer to make room (`None`: forever).
    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }
    /// Writes every byte of `parts`, in order, as one message. Fails with `TimedOut` when
    /// the peer takes no byte for `stall_limit()` (re-read while waiting, so another thread
    /// can shorten it), and with the socket's error (e.g. `BrokenPipe`) when it breaks.
    ///
    /// Why not `SO_SNDTIMEO` and `write_all`: the kernel's send timeout restarts with every
    /// `send` call, and a blocked `send` that had queued part of its buffer returns that part
    /// when the timeout fires; the next call then waits a whole timeout again. A client that
    /// stopped reading was dropped after two timeouts (~122 s for 60 s). Here the limit runs
    /// from the last byte the peer took.
    pub fn send_all(&self, parts: &[&[u8]], stall_limit: impl Fn() -> Duration) -> io::Result<()> {
        if parts.len() > SEND_PARTS_MAX {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many parts for one reply"));
        }
        let fd = self.as_raw_fd();
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut sent = 0usize;
        let mut progress_at = Instant::now();
        // On the stack: this runs once per reply, on the read path's hot loop.
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        let mut iov = [empty; IOVECS_PER_CALL];
        while sent < total {
            let mut used = 0;
            let mut skip = sent;
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                if used == IOVECS_PER_CALL {
                    break;
                }
                let rest = &p[skip..];
                skip = 0;
                iov[used] = libc::iovec { iov_base: rest.as_ptr() as *mut libc::c_void, iov_len: rest.len() };
                used += 1;
            }
            // SAFETY: msghdr is plain data; zeroed is a valid empty header.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = used as _;
            // SAFETY: `msg` points at `iov`, whose entries point into `parts`; all outlive the
            // call. MSG_DONTWAIT: we wait in poll, where the stall limit is enforced;
            // MSG_NOSIGNAL: a vanished client is an error, not a SIGPIPE.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n > 0 {
                sent += n as usize;
                progress_at = Instant::now();
                continue;
            }
            let e = if n == 0 { io::Error::from(io::ErrorKind::WriteZero) } else { io::Error::last_os_error() };
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Err(e),
            }
            let limit = stall_limit();
            let waited = progress_at.elapsed();
            if waited >= limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client took no reply bytes for {:.1} s", waited.as_secs_f64()),
                ));
            }
            let wait = (limit - waited).min(SEND_POLL_SLICE);
            let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, wait.as_millis().max(1) as libc::c_int) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            // Readiness, POLLHUP or POLLERR: the next sendmsg reports which.
        }
        Ok(())
    }

    /// A printable peer name for logs.
    pub fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp:?".into()),
            Stream::Unix(_) => "unix".into(),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// `HOST:PORT` (port 0 picks a free port; the bound one is reported).
    Tcp(String),
    /// A Unix-domain socket path.
    Unix(PathBuf),
}

impl std::fmt::Display for ListenAddr {
    /// As users write it: `127.0.0.1:10809` or `unix:/path`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => f.write_str(a),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A Unix socket file this process bound: removed on drop only while it is still this one.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

/// A bound listening socket.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// Unix-domain socket (its file is removed when the listener is dropped, if still ours).
    Unix(UnixListener, SocketFile),
}

/// Makes room for a Unix socket at `p`: refuses a live socket (a server accepts on it) and
/// anything that is not a socket; removes a stale socket file.
fn clear_stale_socket(p: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(md) = std::fs::symlink_metadata(p) else { return Ok(()) };
    if !md.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", p.display()),
        ));
    }
    match UnixStream::connect(p) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("socket {} is in use by a running server", p.display()),
        )),
        // Nobody listens: a leftover of a server that died without cleaning up.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(p),
        Err(e) => Err(io::Error::new(e.kind(), format!("probing the existing socket {}: {e}", p.display()))),
    }
}

impl Listener {
    /// Binds `addr`. A stale Unix socket file at the path is replaced; a socket a running
    /// server accepts on, or any other file, is an error.
    pub fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        let l = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a.as_str())?),
            ListenAddr::Unix(p) => {
                clear_stale_socket(p)?;
                let listener = UnixListener::bind(p).map_err(|e| {
                    if e.kind() == io::ErrorKind::AddrInUse {
                        // Another server bound it between our probe and our bind.
                        io::Error::new(e.kind(), format!("socket {} is in use by a running server", p.display()))
                    } else {
                        e
                    }
                })?;
                let md = std::fs::symlink_metadata(p)?;
                Listener::Unix(listener, SocketFile { path: p.clone(), dev: md.dev(), ino: md.ino() })
            }
        };
        // Nonblocking so the accept loop can wait on the listener and the stop pipe at once.
        match &l {
            Listener::Tcp(t) => t.set_nonblocking(true)?,
            Listener::Unix(u, _) => u.set_nonblocking(true)?,
        }
        Ok(l)
    }

    /// The bound address as users write it: `127.0.0.1:10809` or `unix:/path`.
    pub fn display_addr(&self) -> String {
        match self {
            Listener::Tcp(t) => t.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into()),
            Listener::Unix(_, f) => format!("unix:{}", f.path.display()),
        }
    }

    /// Accepts one connection as a blocking stream; `WouldBlock` when none is pending.
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(t) => {
                let (s, _) = t.accept()?;
                s.set_nonblocking(false)?;
                // Replies are written header-then-payload; don't let Nagle hold the header.
                s.set_nodelay(true)?;
                widen_send_buffer(s.as_raw_fd());
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(u, _) => {
                let (s, _) = u.accept()?;
                s.set_nonblocking(false)?;
                widen_send_buffer(s.as_raw_fd());
                Ok(Stream::Unix(s))
            }
        }
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Listener::Tcp(t) => t.as_raw_fd(),
            Listener::Unix(u, _) => u.as_raw_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, f) = self {
            // Only our own socket: after a takeover the path names another server's socket.
            // Best effort: a leftover socket file is replaced by the next bind anyway.
            let ours = std::fs::symlink_metadata(&f.path).is_ok_and(|m| m.dev() == f.dev && m.ino() == f.ino);
            if ours {
                let _ = std::fs::remove_file(&f.path);
            }
        }
    }
}

/// Send buffer asked for on every accepted connection (the kernel caps it at
/// `net.core.wmem_max`).
const SEND_BUFFER_BYTES: libc::c_int = 4 << 20;

/// Asks for a send buffer that holds a few large read replies. Why: with the default
/// (about 208 KiB) a 1 MiB reply blocks the worker several times while the client drains
/// the socket, and each block is a sleep and a wake-up on both sides. Best effort: a
/// refusal leaves the default.
pub(crate) fn widen_send_buffer(fd: RawFd) {
    let v: libc::c_int = SEND_BUFFER_BYTES;
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a c_int
    // that lives across the call, and its size is passed with it.
    let _ = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&v as *const libc::c_int).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A reply of more pieces than one `sendmsg` takes (a 4 MiB read of shared cached
    /// blocks and copied ones, alternating) arrives whole and in order.
    #[test]
    fn a_reply_of_more_parts_than_one_system_call_takes_arrives_whole() {
        let (a, mut b) = UnixStream::pair().expect("socketpair");
        let blocks: Vec<Vec<u8>> = (0..SEND_PARTS_MAX - 1).map(|i| vec![(i % 251) as u8; 4096]).collect();
        let mut parts: Vec<&[u8]> = vec![b"header"];
        parts.extend(blocks.iter().map(Vec::as_slice));
        assert!(parts.len() > IOVECS_PER_CALL);
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; total];
            b.read_exact(&mut got).expect("read");
            got
        });
        Stream::Unix(a).send_all(&parts, || Duration::from_secs(10)).expect("send");
        assert_eq!(reader.join().expect("reader"), parts.concat());
        let too_many = vec![&b"x"[..]; SEND_PARTS_MAX + 1];
        let (c, _d) = UnixStream::pair().expect("socketpair");
        assert!(Stream::Unix(c).send_all(&too_many, || Duration::from_secs(1)).is_err(), "beyond the bound is refused");
    }
}
