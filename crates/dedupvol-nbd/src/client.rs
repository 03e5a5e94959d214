//! A small synchronous NBD client: the fixed-newstyle handshake with `NBD_OPT_GO`, then
//! READ, WRITE, FLUSH and DISC with simple replies.
//!
//! Made for load generators and tests (the trace replayer opens one connection per worker),
//! not as a general client: one request is in flight per connection, so a reply always
//! belongs to the last request, and structured replies are never asked for (a server only
//! sends them after `NBD_OPT_STRUCTURED_REPLY`).
//!
//! Invariants:
//! - Every length read from the wire is bounded before it sizes a buffer: option replies by
//!   [`OPTION_DATA_BYTES_MAX`], requests by [`REQUEST_BYTES_MAX`].
//! - Every TCP connect, socket read and socket write is bounded in time by `io_timeout`,
//!   so an unreachable or stalled server fails the client with `TimedOut` instead of
//!   hanging it.
//! - A reply that does not match (magic, cookie) leaves the connection unusable: every
//!   later call fails with [`ClientError::Broken`] rather than reading out of step.

use crate::proto::{
    encode_request, Request, CMD_DISC, CMD_FLUSH, CMD_READ, CMD_WRITE, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES,
    FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO_EXPORT, NBDMAGIC, OPTION_DATA_BYTES_MAX, OPTION_REPLY_MAGIC,
    OPT_GO, REP_ACK, REP_INFO, REQUEST_BYTES_MAX, SIMPLE_REPLY_BYTES, SIMPLE_REPLY_MAGIC, TFLAG_READ_ONLY,
    TFLAG_SEND_FLUSH,
};
use crate::stream::Stream;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// The IANA port of NBD.
pub const NBD_PORT_DEFAULT: u16 = 10809;
/// Default bound on one socket read or write.
pub const IO_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);
/// Longest export name we send (the protocol's limit).
const EXPORT_NAME_BYTES_MAX: usize = 4096;

/// Where an NBD server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    /// `host:port` over TCP.
    Tcp(String),
    /// A Unix-domain socket.
    Unix(PathBuf),
}

/// A parsed NBD URI: `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// The server.
    pub address: NbdAddress,
    /// The export name (may be empty: the server's default export).
    pub export: String,
}

impl NbdUri {
    /// Parses the two URI forms of the NBD URI specification this client speaks (no TLS,
    /// no percent-encoding beyond what paths need in practice).
    pub fn parse(uri: &str) -> Result<NbdUri, ClientError> {
        let bad = |why: &str| ClientError::Uri { uri: uri.to_string(), reason: why.to_string() };
        if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            let (path_part, query) = rest.split_once('?').ok_or_else(|| bad("missing ?socket=PATH"))?;
            if !path_part.is_empty() && !path_part.starts_with('/') {
                return Err(bad("a Unix socket URI has no host: nbd+unix:///EXPORT?socket=PATH"));
            }
            let export = path_part.strip_prefix('/').unwrap_or(path_part).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|s| !s.is_empty())
                .ok_or_else(|| bad("missing socket=PATH"))?;
            return Ok(NbdUri { address: NbdAddress::Unix(PathBuf::from(socket)), export });
        }
        if let Some(rest) = uri.strip_prefix("nbd://") {
            let (authority, export) = match rest.split_once('/') {
                Some((a, e)) => (a, e.to_string()),
                None => (rest, String::new()),
            };
            if authority.is_empty() {
                return Err(bad("missing host"));
            }
            // A bracketed IPv6 literal keeps its colons; the port follows the bracket.
            let has_port = match authority.rfind(']') {
                Some(end) => authority[end..].contains(':'),
                None => authority.contains(':'),
            };
            let host_port = if has_port { authority.to_string() } else { format!("{authority}:{NBD_PORT_DEFAULT}") };
            return Ok(NbdUri { address: NbdAddress::Tcp(host_port), export });
        }
        Err(bad("expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"))
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.address {
            NbdAddress::Tcp(a) => write!(f, "nbd://{a}/{}", self.export),
            NbdAddress::Unix(p) => write!(f, "nbd+unix:///{}?socket={}", self.export, p.display()),
        }
    }
}

/// What went wrong talking to a server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URI does not parse.
    #[error("NBD URI {uri:?}: {reason}")]
    Uri {
        /// The URI.
        uri: String,
        /// Why.
        reason: String,
    },
    /// A socket call failed (including `TimedOut` when the server stalls).
    #[error("NBD {during}: {source}")]
    Io {
        /// What the client was doing.
        during: &'static str,
        /// The socket error.
        source: io::Error,
    },
    /// The server broke the protocol.
    #[error("NBD protocol error during {during}: {detail}")]
    Protocol {
        /// What the client was doing.
        during: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The server refused the export.
    #[error("NBD server refused export {export:?}: reply {reply:#x}: {message}")]
    Refused {
        /// The export asked for.
        export: String,
        /// The option reply type (an error type).
        reply: u32,
        /// The server's message.
        message: String,
    },
    /// A command failed on the server.
    #[error("NBD {command} of {len} bytes at offset {offset} failed on the server: error {error} ({})", nbd_error_name(*error))]
    Command {
        /// READ, WRITE or FLUSH.
        command: &'static str,
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u32,
        /// The NBD error code.
        error: u32,
    },
    /// The request is outside what the export allows (checked before sending).
    #[error("NBD {command} of {len} bytes at offset {offset}: {reason}")]
    Rejected {
        /// READ or WRITE.
        command: &'static str,
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: usize,
        /// Why.
        reason: String,
    },
    /// An earlier failure left the connection out of step.
    #[error("NBD connection unusable after an earlier error")]
    Broken,
}

/// The name of an NBD error code.
pub fn nbd_error_name(code: u32) -> &'static str {
    match code {
        1 => "EPERM",
        5 => "EIO",
        12 => "ENOMEM",
        22 => "EINVAL",
        28 => "ENOSPC",
        75 => "EOVERFLOW",
        95 => "ENOTSUP",
        108 => "ESHUTDOWN",
        _ => "unknown",
    }
}

/// One connection to an export, in transmission phase.
#[derive(Debug)]
pub struct NbdClient {
    stream: Stream,
    size_bytes: u64,
    transmission_flags: u16,
    cookie: u64,
    broken: bool,
}

fn io_err(during: &'static str) -> impl Fn(io::Error) -> ClientError {
    move |source| ClientError::Io { during, source }
}

fn read_u16(s: &mut Stream, during: &'static str) -> Result<u16, ClientError> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b).map_err(io_err(during))?;
    Ok(u16::from_be_bytes(b))
}
fn read_u32(s: &mut Stream, during: &'static str) -> Result<u32, ClientError> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b).map_err(io_err(during))?;
    Ok(u32::from_be_bytes(b))
}
fn read_u64(s: &mut Stream, during: &'static str) -> Result<u64, ClientError> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).map_err(io_err(during))?;
    Ok(u64::from_be_bytes(b))
}

impl NbdClient {
    /// Connects to `uri` and enters transmission on its export.
    pub fn connect(uri: &NbdUri, io_timeout: Duration) -> Result<NbdClient, ClientError> {
        let stream = match &uri.address {
            NbdAddress::Tcp(a) => {
                // connect_timeout, not connect: an unreachable host would otherwise hold the
                // caller for the kernel's SYN retries (minutes).
                let addrs: Vec<SocketAddr> = a.to_socket_addrs().map_err(io_err("resolving the server"))?.collect();
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{a} resolves to no address"));
                let mut connected = None;
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, io_timeout) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                let s = connected.ok_or(ClientError::Io { during: "connect", source: last })?;
                // Requests are small and answered one at a time: Nagle would delay each.
                s.set_nodelay(true).map_err(io_err("connect"))?;
                Stream::Tcp(s)
            }
            NbdAddress::Unix(p) => Stream::Unix(UnixStream::connect(p).map_err(io_err("connect"))?),
        };
        stream.set_read_timeout(Some(io_timeout)).map_err(io_err("connect"))?;
        stream.set_write_timeout(Some(io_timeout)).map_err(io_err("connect"))?;
        Self::handshake(stream, &uri.export)
    }

    fn handshake(mut s: Stream, export: &str) -> Result<NbdClient, ClientError> {
        const D: &str = "handshake";
        let proto = |detail: String| ClientError::Protocol { during: D, detail };
        if export.len() > EXPORT_NAME_BYTES_MAX {
            return Err(proto(format!("export name of {} bytes is too long", export.len())));
        }
        let magic = read_u64(&mut s, D)?;
        if magic != NBDMAGIC {
            return Err(proto(format!("bad greeting magic {magic:#x}")));
        }
        let opt_magic = read_u64(&mut s, D)?;
        if opt_magic != IHAVEOPT {
            return Err(proto(format!("server is not newstyle (magic {opt_magic:#x})")));
        }
        let flags = read_u16(&mut s, D)?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(proto("server does not speak fixed newstyle".into()));
        }
        let mut client_flags = FLAG_C_FIXED_NEWSTYLE;
        if flags & FLAG_NO_ZEROES != 0 {
            client_flags |= FLAG_C_NO_ZEROES;
        }
        // NBD_OPT_GO: name length, name, no information requests.
        let mut data = Vec::with_capacity(6 + export.len());
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut msg = Vec::with_capacity(20 + data.len());
        msg.extend_from_slice(&client_flags.to_be_bytes());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&OPT_GO.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(&data);
        s.write_all(&msg).map_err(io_err(D))?;
        let mut export_info: Option<(u64, u16)> = None;
        loop {
            let magic = read_u64(&mut s, D)?;
            if magic != OPTION_REPLY_MAGIC {
                return Err(proto(format!("bad option reply magic {magic:#x}")));
            }
            let option = read_u32(&mut s, D)?;
            let reply = read_u32(&mut s, D)?;
            let len = read_u32(&mut s, D)?;
            if option != OPT_GO {
                return Err(proto(format!("reply to option {option}, expected GO")));
            }
            if len > OPTION_DATA_BYTES_MAX {
                return Err(proto(format!("option reply of {len} bytes exceeds {OPTION_DATA_BYTES_MAX}")));
            }
            let mut payload = vec![0u8; len as usize];
            s.read_exact(&mut payload).map_err(io_err(D))?;
            match reply {
                REP_ACK => break,
                REP_INFO => {
                    // Only NBD_INFO_EXPORT matters here; other information is skipped.
                    if payload.len() >= 2 && u16::from_be_bytes([payload[0], payload[1]]) == INFO_EXPORT {
                        if payload.len() != 12 {
                            return Err(proto(format!("INFO_EXPORT of {} bytes, expected 12", payload.len())));
                        }
                        let mut size = [0u8; 8];
                        size.copy_from_slice(&payload[2..10]);
                        export_info = Some((u64::from_be_bytes(size), u16::from_be_bytes([payload[10], payload[11]])));
                    }
                }
                r if r & (1 << 31) != 0 => {
                    return Err(ClientError::Refused {
                        export: export.to_string(),
                        reply: r,
                        message: String::from_utf8_lossy(&payload).into_owned(),
                    })
                }
                r => return Err(proto(format!("unexpected option reply type {r:#x}"))),
            }
        }
        let (size_bytes, transmission_flags) =
            export_info.ok_or_else(|| proto("server acknowledged GO without NBD_INFO_EXPORT".into()))?;
        Ok(NbdClient { stream: s, size_bytes, transmission_flags, cookie: 0, broken: false })
    }

    /// The export's size, in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether the export is read-only.
    pub fn read_only(&self) -> bool {
        self.transmission_flags & TFLAG_READ_ONLY != 0
    }

    fn check_range(&self, command: &'static str, offset: u64, len: usize) -> Result<(), ClientError> {
        let reject = |reason: String| ClientError::Rejected { command, offset, len, reason };
        if len as u64 > u64::from(REQUEST_BYTES_MAX) {
            return Err(reject(format!("longer than the {REQUEST_BYTES_MAX}-byte request maximum")));
        }
        if offset.checked_add(len as u64).is_none_or(|end| end > self.size_bytes) {
            return Err(reject(format!("beyond the export's {} bytes", self.size_bytes)));
        }
        Ok(())
    }

    /// Sends a request and reads its simple reply header; returns the error code.
    fn call(
        &mut self,
        kind: u16,
        command: &'static str,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> Result<(), ClientError> {
        if self.broken {
            return Err(ClientError::Broken);
        }
        // Marked broken until the reply header is read in step.
        self.broken = true;
        self.cookie = self.cookie.wrapping_add(1);
        let header = encode_request(&Request { flags: 0, kind, cookie: self.cookie, offset, len });
        self.stream.write_all(&header).map_err(io_err("sending a request"))?;
        if !payload.is_empty() {
            self.stream.write_all(payload).map_err(io_err("sending write data"))?;
        }
        let mut reply = [0u8; SIMPLE_REPLY_BYTES];
        self.stream.read_exact(&mut reply).map_err(io_err("reading a reply"))?;
        let magic = u32::from_be_bytes([reply[0], reply[1], reply[2], reply[3]]);
        let error = u32::from_be_bytes([reply[4], reply[5], reply[6], reply[7]]);
        let mut c = [0u8; 8];
        c.copy_from_slice(&reply[8..16]);
        let cookie = u64::from_be_bytes(c);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(ClientError::Protocol {
                during: "reading a reply",
                detail: format!("bad reply magic {magic:#x} (structured replies were not asked for)"),
            });
        }
        if cookie != self.cookie {
            return Err(ClientError::Protocol {
                during: "reading a reply",
                detail: format!("reply cookie {cookie} for request {}", self.cookie),
            });
        }
        if error != 0 {
            // A failed read has no data after the header: the stream is still in step.
            self.broken = false;
            return Err(ClientError::Command { command, offset, len, error });
        }
        self.broken = false;
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        self.check_range("READ", offset, buf.len())?;
        self.call(CMD_READ, "READ", offset, buf.len() as u32, &[])?;
        // The data follows a successful reply header; out of step until it is all read.
        self.broken = true;
        self.stream.read_exact(buf).map_err(io_err("reading read data"))?;
        self.broken = false;
        Ok(())
    }

    /// Writes `data` at `offset` (acknowledged when the server has it, not necessarily durable).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        self.check_range("WRITE", offset, data.len())?;
        if self.read_only() {
            return Err(ClientError::Rejected {
                command: "WRITE",
                offset,
                len: data.len(),
                reason: "the export is read-only".into(),
            });
        }
        self.call(CMD_WRITE, "WRITE", offset, data.len() as u32, data)
    }

    /// Makes completed writes durable (a no-op when the server does not offer FLUSH).
    pub fn flush(&mut self) -> Result<(), ClientError> {
        if self.transmission_flags & TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.call(CMD_FLUSH, "FLUSH", 0, 0, &[])
    }

    /// Ends the session politely (NBD_CMD_DISC has no reply) and closes the socket.
    pub fn disconnect(mut self) -> Result<(), ClientError> {
        if self.broken {
            return Ok(());
        }
        self.cookie = self.cookie.wrapping_add(1);
        let header = encode_request(&Request { flags: 0, kind: CMD_DISC, cookie: self.cookie, offset: 0, len: 0 });
        self.stream.write_all(&header).map_err(io_err("disconnecting"))?;
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse() {
        let u = NbdUri::parse("nbd://127.0.0.1:10810/vol").expect("tcp");
        assert_eq!(u.address, NbdAddress::Tcp("127.0.0.1:10810".into()));
        assert_eq!(u.export, "vol");
        let u = NbdUri::parse("nbd://example.com").expect("default port");
        assert_eq!(u.address, NbdAddress::Tcp("example.com:10809".into()));
        assert_eq!(u.export, "");
        let u = NbdUri::parse("nbd://[::1]/x").expect("ipv6");
        assert_eq!(u.address, NbdAddress::Tcp("[::1]:10809".into()));
        let u = NbdUri::parse("nbd+unix:///dedupvol?socket=/tmp/a.sock").expect("unix");
        assert_eq!(u.address, NbdAddress::Unix("/tmp/a.sock".into()));
        assert_eq!(u.export, "dedupvol");
        for bad in ["nbd+unix:///x", "nbd+unix://host/x?socket=/s", "http://x", "nbd:///x", "nbd+unix:///x?socket="] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} parsed");
        }
    }
}
