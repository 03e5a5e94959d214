//! TCP and Unix-domain sockets behind one type, so the server code is written once.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

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
    /// A printable peer name for logs.
    pub fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp:?".into()),
            Stream::Unix(_) => "unix".into(),
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

/// A bound listening socket.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// Unix-domain socket (the path is removed when the listener is dropped).
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `addr`. A stale Unix socket file at the path is replaced; any other file is not.
    pub fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        let l = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a.as_str())?),
            ListenAddr::Unix(p) => {
                use std::os::unix::fs::FileTypeExt;
                if let Ok(md) = std::fs::symlink_metadata(p) {
                    if md.file_type().is_socket() {
                        std::fs::remove_file(p)?;
                    } else {
                        return Err(io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            format!("{} exists and is not a socket", p.display()),
                        ));
                    }
                }
                Listener::Unix(UnixListener::bind(p)?, p.clone())
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
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
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
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(u, _) => {
                let (s, _) = u.accept()?;
                s.set_nonblocking(false)?;
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
        if let Listener::Unix(_, p) = self {
            // Best effort: a leftover socket file is replaced by the next bind anyway.
            let _ = std::fs::remove_file(p);
        }
    }
}
