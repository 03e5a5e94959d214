//! A small side service of `serve` (the admin socket, the metrics endpoint): one thread
//! that accepts on a listener and answers one client at a time, until stopped.
//!
//! Invariants:
//! - One client at a time, each with read and write timeouts of [`CLIENT_TIMEOUT`]: the
//!   service holds at most one connection and one thread, whatever clients do; a client
//!   that stalls delays the next by at most the timeout.
//! - A failed or panicking answer costs that client only; the service goes on.
//! - [`Service::stop`] returns only after the thread has exited and dropped its handler,
//!   so whatever the handler holds (the volume) is released before the volume is closed.

use dedupvol_nbd::stream::Stream;
use dedupvol_nbd::Listener;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest a client may take to send its request or take its answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// A running service.
pub struct Service {
    stop: UnixStream,
    thread: Option<JoinHandle<()>>,
    address: String,
}

impl Service {
    /// Starts answering clients of `listener` with `handle` on a thread named `name`.
    pub fn spawn(
        name: &str,
        listener: Listener,
        handle: impl Fn(&mut Stream) -> io::Result<()> + Send + 'static,
    ) -> io::Result<Service> {
        let (stop_read, stop) = UnixStream::pair()?;
        let address = listener.display_addr();
        let log_name = name.to_string();
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            while wait_client(listener.as_raw_fd(), stop_read.as_raw_fd()) {
                let mut s = match listener.accept() {
                    Ok(s) => s,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                        continue
                    }
                    Err(e) => {
                        let _ = writeln!(io::stderr(), "dedupvol: {log_name}: accept failed: {e}");
                        continue;
                    }
                };
                // A client that went away or timed out concerns only itself; a bug in
                // answering one must not take the service down for the next.
                let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    s.set_read_timeout(Some(CLIENT_TIMEOUT))
                        .and_then(|()| s.set_write_timeout(Some(CLIENT_TIMEOUT)))
                        .and_then(|()| handle(&mut s))
                }));
                if answered.is_err() {
                    let _ = writeln!(io::stderr(), "dedupvol: {log_name}: answering a client panicked");
                }
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        })?;
        Ok(Service { stop, thread: Some(thread), address })
    }

    /// Where it listens (`127.0.0.1:9100`, `unix:/path`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Stops the thread and waits for it (a client being answered gets its answer first,
    /// within the client timeout). Its listener, and a Unix socket file, go with it.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = (&self.stop).write_all(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Waits until a client is pending (true) or the stop socket is readable or closed, or
/// polling fails (false).
fn wait_client(listener: i32, stop: i32) -> bool {
    matches!(dedupvol_nbd::server::wait_readable(listener, stop), Ok(dedupvol_nbd::server::Ready::Listener))
}

/// Reads one request line of at most `max` bytes (without its newline); `None` when the
/// client sent more than that without a newline, or nothing at all.
pub fn read_line(s: &mut Stream, max: usize) -> io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(128);
    let mut byte = [0u8; 1];
    while buf.len() <= max {
        match s.read(&mut byte)? {
            0 => break,
            _ if byte[0] == b'\n' => return Ok(Some(String::from_utf8_lossy(&buf).trim().to_string())),
            _ => buf.push(byte[0]),
        }
    }
    Ok(if buf.is_empty() || buf.len() > max { None } else { Some(String::from_utf8_lossy(&buf).trim().to_string()) })
}
