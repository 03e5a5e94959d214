//! TLS for NBD connections (`NBD_OPT_STARTTLS`), with rustls.
//!
//! A client that sends `NBD_OPT_STARTTLS` gets an ACK, then the TLS handshake runs on its
//! socket; negotiation and transmission go on inside TLS. The rest of the server never
//! sees TLS: after the handshake a *pump* thread moves bytes between the client's TLS
//! session and one end of a Unix socket pair, and the connection code carries on with the
//! other end as an ordinary [`Stream`]. So the reply path's vectored, stall-limited writes
//! and the shutdown sequence (shut the client socket's read half; the pump passes the
//! end-of-file on) work unchanged, at the price of one extra copy per byte, which is small
//! next to the cipher.
//!
//! Who may connect: with a client CA, every client must present a certificate it signed;
//! with an allow-list as well, the certificate's subject common name or one of its DNS
//! subject-alternative names must be on it. A client whose certificate is not allowed is
//! disconnected right after the handshake.
//!
//! Invariants:
//! - The pump holds at most [`PLAINTEXT_BUFFER_BYTES`] (plus one TLS record) of decrypted
//!   client bytes, and takes the connection's replies only when rustls has nothing left to
//!   send, one [`PUMP_CHUNK_BYTES`] chunk at a time; beyond that it stops reading the side
//!   that produces them (backpressure, never unbounded buffering).
//! - The handshake is bounded by the connection's handshake timeout.
//! - The pump ends when both directions have ended or either socket fails; it then closes
//!   its end of the pair, so the connection code sees end-of-file, never a hang.

use crate::stream::Stream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Decrypted client bytes held by the pump before it stops reading the client.
pub const PLAINTEXT_BUFFER_BYTES: usize = 256 << 10;
/// Encrypted bytes rustls may buffer for the client (a bound on top of the pump's own).
pub const TLS_BUFFER_BYTES: usize = 1 << 20;
/// Reply bytes the pump takes from the connection at a time.
pub const PUMP_CHUNK_BYTES: usize = 64 << 10;
/// Longest a names allow-list may be.
pub const ALLOWED_NAMES_MAX: usize = 1024;

/// Where the server's TLS material lives.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM certificate chain of the server (leaf first).
    pub cert: PathBuf,
    /// PEM private key of the server (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificates that client certificates must chain to; none: clients are not
    /// asked for certificates.
    pub client_ca: Option<PathBuf>,
    /// Client names allowed in (subject CN or DNS SAN); empty: any client the CA signed.
    pub allowed_names: Vec<String>,
}

/// TLS settings of a server, ready to accept clients.
#[derive(Clone)]
pub struct TlsPolicy {
    config: Arc<rustls::ServerConfig>,
    allowed_names: Arc<[String]>,
    /// Clients must upgrade before anything but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT`.
    pub required: bool,
}

impl std::fmt::Debug for TlsPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPolicy")
            .field("required", &self.required)
            .field("allowed_names", &self.allowed_names)
            .finish_non_exhaustive()
    }
}

/// A TLS setting that cannot be used, with what and why.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {why}")]
pub struct TlsSetupError {
    what: String,
    why: String,
}

fn setup_err(what: impl Into<String>, why: impl std::fmt::Display) -> TlsSetupError {
    TlsSetupError { what: what.into(), why: why.to_string() }
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| setup_err(format!("{what} {}", path.display()), e))?;
    let certs: Vec<_> =
        iter.collect::<Result<_, _>>().map_err(|e| setup_err(format!("{what} {}", path.display()), e))?;
    if certs.is_empty() {
        return Err(setup_err(format!("{what} {}", path.display()), "no PEM certificate in it"));
    }
    Ok(certs)
}

impl TlsPolicy {
    /// Loads the certificate, key and client CA, and builds the rustls configuration.
    pub fn load(files: &TlsFiles, required: bool) -> Result<TlsPolicy, TlsSetupError> {
        if files.allowed_names.len() > ALLOWED_NAMES_MAX {
            return Err(setup_err("client allow-list", format!("more than {ALLOWED_NAMES_MAX} names")));
        }
        if !files.allowed_names.is_empty() && files.client_ca.is_none() {
            return Err(setup_err(
                "client allow-list",
                "needs a client CA: without one, clients present no certificate to take names from",
            ));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = read_certs(&files.cert, "server certificate")?;
        let key = PrivateKeyDer::from_pem_file(&files.key)
            .map_err(|e| setup_err(format!("server key {}", files.key.display()), e))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| setup_err("TLS protocol versions", e))?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certs(ca, "client CA")? {
                    roots.add(c).map_err(|e| setup_err(format!("client CA {}", ca.display()), e))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| setup_err(format!("client CA {}", ca.display()), e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(chain, key)
            .map_err(|e| setup_err(format!("server certificate {} and key", files.cert.display()), e))?;
        Ok(TlsPolicy { config: Arc::new(config), allowed_names: files.allowed_names.clone().into(), required })
    }
}

/// Names a certificate carries: its subject common names and DNS subject-alternative
/// names. An unparsable certificate has none.
pub fn certificate_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return Vec::new() };
    let mut names: Vec<String> =
        cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok().map(str::to_string)).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push((*d).to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// A TLS session in service: the plain stream the connection goes on with, and the pump.
pub struct Upgraded {
    /// The connection's end of the socket pair.
    pub stream: Stream,
    /// The pump thread; joined by the connection when it ends.
    pub pump: JoinHandle<()>,
    /// Names from the client's certificate (empty without client authentication).
    pub client_names: Vec<String>,
}

/// Runs the TLS handshake on `tcp` (after the ACK to `NBD_OPT_STARTTLS` was sent) within
/// `timeout`, checks the client against the allow-list, and starts the pump.
pub fn upgrade(client: Stream, policy: &TlsPolicy, timeout: Duration) -> io::Result<Upgraded> {
    let mut conn = rustls::ServerConnection::new(policy.config.clone()).map_err(io::Error::other)?;
    conn.set_buffer_limit(Some(TLS_BUFFER_BYTES));
    let deadline = Instant::now() + timeout;
    let mut sock = client;
    sock.set_write_timeout(Some(timeout))?;
    while conn.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "TLS handshake took too long"));
        }
        sock.set_read_timeout(Some(left))?;
        // complete_io reads, processes and writes until the handshake needs the peer.
        match conn.complete_io(&mut sock) {
            Ok((0, 0)) if conn.is_handshaking() => {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "client left during the TLS handshake"))
            }
            Ok(_) => {}
            Err(e) => {
                // Send whatever alert rustls queued, so the client sees why.
                let _ = conn.write_tls(&mut sock);
                return Err(io::Error::new(e.kind(), format!("TLS handshake: {e}")));
            }
        }
    }
    let client_names =
        conn.peer_certificates().and_then(|c| c.first()).map(|c| certificate_names(c.as_ref())).unwrap_or_default();
    if !policy.allowed_names.is_empty() && !client_names.iter().any(|n| policy.allowed_names.contains(n)) {
        conn.send_close_notify();
        let _ = conn.write_tls(&mut sock);
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("client certificate names {client_names:?} are not on the allow-list"),
        ));
    }
    sock.set_read_timeout(None)?;
    sock.set_write_timeout(None)?;
    let (ours, theirs) = UnixStream::pair()?;
    // The connection's writes into the pair behave like writes to the client socket.
    crate::stream::widen_send_buffer(theirs.as_raw_fd());
    let pump = std::thread::Builder::new().name("nbd-tls".into()).spawn(move || pump(conn, sock, ours))?;
    Ok(Upgraded { stream: Stream::Unix(theirs), pump, client_names })
}

/// Moves bytes both ways until both directions end or a socket fails (module docs).
fn pump(mut conn: rustls::ServerConnection, tcp: Stream, local: UnixStream) {
    let _ = pump_inner(&mut conn, &tcp, &local);
    let _ = local.shutdown(Shutdown::Both);
    let _ = tcp.shutdown(Shutdown::Both);
}

fn pump_inner(conn: &mut rustls::ServerConnection, tcp: &Stream, local: &UnixStream) -> io::Result<()> {
    tcp.set_nonblocking(true)?;
    local.set_nonblocking(true)?;
    let mut tcp_r = tcp.try_clone()?;
    let mut tcp_w = tcp.try_clone()?;
    let mut local_r = local;
    let mut local_w = local;
    // Decrypted client bytes not yet taken by the connection.
    let mut to_local: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut to_local_at = 0usize;
    let mut chunk = vec![0u8; PUMP_CHUNK_BYTES];
    let mut client_eof = false; // the client's side ended (close_notify, EOF)
    let mut local_eof = false; // the connection finished writing replies
    let mut local_shut = false; // end-of-file passed on to the connection
    loop {
        // Client -> connection.
        if to_local_at < to_local.len() {
            match local_w.write(to_local.get(to_local_at..).unwrap_or_default()) {
                Ok(n) => to_local_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if to_local_at == to_local.len() {
                to_local.clear();
                to_local_at = 0;
            }
        }
        if client_eof && to_local.is_empty() && !local_shut {
            let _ = local.shutdown(Shutdown::Write);
            local_shut = true;
        }
        // Connection -> client: take replies only once rustls has handed everything it
        // encrypted to the socket, so at most one chunk waits in rustls (backpressure).
        if !local_eof && !conn.wants_write() {
            match local_r.read(&mut chunk) {
                Ok(0) => {
                    local_eof = true;
                    conn.send_close_notify();
                }
                Ok(n) => conn.writer().write_all(chunk.get(..n).unwrap_or_default())?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        while conn.wants_write() {
            match conn.write_tls(&mut tcp_w) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if local_eof && !conn.wants_write() {
            return Ok(());
        }
        // Read the client only while the connection keeps up with what was decrypted.
        let want_client = !client_eof && to_local.len() < PLAINTEXT_BUFFER_BYTES;
        let mut received = false;
        if want_client {
            match conn.read_tls(&mut tcp_r) {
                Ok(0) => client_eof = true,
                Ok(_) => {
                    conn.process_new_packets().map_err(|e| {
                        let _ = conn.write_tls(&mut tcp_w);
                        io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
                    })?;
                    received = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => client_eof = true,
                Err(e) => return Err(e),
            }
        }
        // Take what rustls decrypted, including requests that arrived with the end of the
        // handshake (they are already inside rustls, and no socket event announces them).
        while to_local.len() < PLAINTEXT_BUFFER_BYTES {
            match conn.reader().read(&mut chunk) {
                Ok(0) => {
                    client_eof = true;
                    break;
                }
                Ok(n) => to_local.extend_from_slice(chunk.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    client_eof = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if received {
            continue;
        }
        // Nothing moved without waiting: sleep until a socket is ready.
        let mut fds = [
            libc::pollfd { fd: tcp.as_raw_fd(), events: 0, revents: 0 },
            libc::pollfd { fd: local.as_raw_fd(), events: 0, revents: 0 },
        ];
        if want_client {
            fds[0].events |= libc::POLLIN;
        }
        if conn.wants_write() {
            fds[0].events |= libc::POLLOUT;
        }
        if !local_eof && !conn.wants_write() {
            fds[1].events |= libc::POLLIN;
        }
        if !to_local.is_empty() {
            fds[1].events |= libc::POLLOUT;
        }
        // A socket nothing is wanted from is left out: a hung-up socket reports POLLHUP
        // whatever the events asked, which would turn this wait into a spin.
        for f in &mut fds {
            if f.events == 0 {
                f.fd = -1;
            }
        }
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allow_list_without_a_client_ca_is_refused() {
        let files = TlsFiles {
            cert: "/nonexistent".into(),
            key: "/nonexistent".into(),
            client_ca: None,
            allowed_names: vec!["a".into()],
        };
        let e = TlsPolicy::load(&files, true).expect_err("refused");
        assert!(e.to_string().contains("needs a client CA"), "{e}");
    }

    #[test]
    fn missing_files_are_named() {
        let files =
            TlsFiles { cert: "/nonexistent/cert.pem".into(), key: "/nonexistent/key.pem".into(), ..Default::default() };
        let e = TlsPolicy::load(&files, true).expect_err("refused");
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
    }

    #[test]
    fn garbage_is_no_certificate() {
        assert!(certificate_names(b"not a certificate").is_empty());
    }
}
