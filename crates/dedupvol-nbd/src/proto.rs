//! NBD wire format: constants, and pure parsers and encoders over byte slices.
//!
//! Written from the protocol specification (NetworkBlockDevice/nbd `doc/proto.md`): fixed
//! newstyle handshake, option haggling, simple and structured replies. Nothing here does I/O, so every
//! decoder can be fed arbitrary bytes by the fuzz target and the property tests.
//!
//! Invariants:
//! - No parser panics or allocates more than its input's length (plus a bounded constant)
//!   on any input; malformed input is an `Err`, never a panic.
//! - Every length taken from the wire is checked against a named bound before it is used
//!   to size a buffer: option data <= [`OPTION_DATA_BYTES_MAX`], export names <=
//!   [`NAME_BYTES_MAX`], request payloads <= [`REQUEST_BYTES_MAX`].
//! - [`classify_request`] decides the whole fate of a request (execute, reject with an
//!   NBD error after consuming its payload, or drop the connection) from the header and
//!   the export alone, so the connection code holds no protocol policy of its own.

/// "NBDMAGIC": first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation magic, sent by the server and before each option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic at the start of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic at the start of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic at the start of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic at the start of every structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Structured reply flag: this is the last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Structured chunk: no payload (success, when no error chunk came before).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Structured chunk: offset + data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Structured chunk: offset + length of a run of zeros.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Structured chunk: error + message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Size of a structured reply chunk header.
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;
/// Longest error message we put in an error chunk (the spec's limit is 4096).
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1024;

/// Handshake flags (server → client, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// The server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (client → server, 32 bits).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// The client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags (16 bits).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// The server understands `NBD_CMD_FLUSH`.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// The server understands `NBD_CMD_FLAG_FUA`.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// The server understands `NBD_CMD_TRIM`.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// The server understands `NBD_CMD_WRITE_ZEROES`.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// A flush on any connection covers writes completed on all connections.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
/// Abort negotiation.
pub const OPT_ABORT: u32 = 2;
/// List exports.
pub const OPT_LIST: u32 = 3;
/// Upgrade the connection to TLS before going on negotiating.
pub const OPT_STARTTLS: u32 = 5;
/// Export details without entering transmission.
pub const OPT_INFO: u32 = 6;
/// Export details, then enter transmission.
pub const OPT_GO: u32 = 7;
/// Use structured replies in transmission.
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// Option reply types.
pub const REP_ACK: u32 = 1;
/// One export in a `NBD_OPT_LIST` answer.
pub const REP_SERVER: u32 = 2;
/// One information item in an INFO/GO answer.
pub const REP_INFO: u32 = 3;
const REP_FLAG_ERROR: u32 = 1 << 31;
/// The option is not supported.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// The option is forbidden by server policy (sent, with the reason, to a client refused at
/// the connection limit).
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// The option is syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// The server requires TLS before this option (`NBD_REP_ERR_TLS_REQD`).
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// The export does not exist.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// The server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// The option request or reply is too large.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

/// Information types in INFO/GO.
pub const INFO_EXPORT: u16 = 0;
/// Export name.
pub const INFO_NAME: u16 = 1;
/// Export description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command types.
pub const CMD_READ: u16 = 0;
/// Write.
pub const CMD_WRITE: u16 = 1;
/// Soft disconnect.
pub const CMD_DISC: u16 = 2;
/// Flush.
pub const CMD_FLUSH: u16 = 3;
/// Trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Write zeroes must allocate (no hole).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// NBD error codes (the protocol's own numbering, not the host's errno).
pub const NBD_EPERM: u32 = 1;
/// I/O error.
pub const NBD_EIO: u32 = 5;
/// Out of memory.
pub const NBD_ENOMEM: u32 = 12;
/// Invalid argument.
pub const NBD_EINVAL: u32 = 22;
/// No space left.
pub const NBD_ENOSPC: u32 = 28;
/// Value too large.
pub const NBD_EOVERFLOW: u32 = 75;
/// Server shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

/// Size of a transmission request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Size of an option request header (magic, option, length).
pub const OPTION_HEADER_BYTES: usize = 16;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Largest READ/WRITE payload we accept; advertised as the maximum block size. 32 MiB is
/// the spec's default maximum, so clients that never ask for block sizes stay within it.
pub const REQUEST_BYTES_MAX: u32 = 32 << 20;
/// Preferred block size advertised: the engine's chunk size, so requests never split chunks.
pub const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Minimum block size advertised: the engine handles unaligned requests itself.
pub const MINIMUM_BLOCK_BYTES: u32 = 1;
/// Longest string the spec allows (export names, messages).
pub const NAME_BYTES_MAX: usize = 4096;
/// Largest option payload we read; anything longer closes the connection (the largest
/// valid option we understand is INFO/GO: 4 + 4096 + 2 + a short list of info types).
pub const OPTION_DATA_BYTES_MAX: u32 = 64 << 10;
/// Most information requests we look at in one INFO/GO (there are 4 defined types).
pub const INFO_REQUESTS_MAX: usize = 64;

/// A malformed message: the connection cannot continue in sync with the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Wrong length for a fixed-size message.
    #[error("{what}: expected {expected} bytes, got {got}")]
    Length {
        /// The message.
        what: &'static str,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Wrong magic number.
    #[error("{what}: bad magic {got:#x}")]
    Magic {
        /// The message.
        what: &'static str,
        /// The magic received.
        got: u64,
    },
    /// A field is out of its allowed range.
    #[error("{0}")]
    Invalid(String),
}

fn be_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes(s.try_into().ok()?))
}
fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes(s.try_into().ok()?))
}
fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    Some(u64::from_be_bytes(s.try_into().ok()?))
}

fn exact(what: &'static str, b: &[u8], n: usize) -> Result<(), ParseError> {
    if b.len() == n {
        Ok(())
    } else {
        Err(ParseError::Length { what, expected: n, got: b.len() })
    }
}

/// The server's opening bytes: NBDMAGIC, IHAVEOPT, handshake flags.
pub fn encode_greeting() -> [u8; 18] {
    let mut out = [0u8; 18];
    out[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    out
}

/// What the client asked for in its 32-bit flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    /// The client speaks fixed newstyle.
    pub fixed_newstyle: bool,
    /// The client wants no zero padding after EXPORT_NAME.
    pub no_zeroes: bool,
}

/// Parses the client's flags. Unknown bits are an error: the spec requires the server to
/// close the connection when the client sets a flag it does not know.
pub fn parse_client_flags(b: &[u8]) -> Result<ClientFlags, ParseError> {
    exact("client flags", b, 4)?;
    let f = be_u32(b, 0).ok_or_else(|| ParseError::Invalid("client flags".into()))?;
    if f & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(ParseError::Invalid(format!("unknown client flags {f:#x}")));
    }
    Ok(ClientFlags { fixed_newstyle: f & FLAG_C_FIXED_NEWSTYLE != 0, no_zeroes: f & FLAG_C_NO_ZEROES != 0 })
}

/// An option request header; `len` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option type.
    pub option: u32,
    /// Length of the option data.
    pub len: u32,
}

/// Parses an option header. An oversized length is an error (the caller closes the
/// connection rather than reading an attacker-chosen amount).
pub fn parse_option_header(b: &[u8]) -> Result<OptionHeader, ParseError> {
    exact("option header", b, OPTION_HEADER_BYTES)?;
    let magic = be_u64(b, 0).unwrap_or(0);
    if magic != IHAVEOPT {
        return Err(ParseError::Magic { what: "option header", got: magic });
    }
    let option = be_u32(b, 8).unwrap_or(0);
    let len = be_u32(b, 12).unwrap_or(0);
    if len > OPTION_DATA_BYTES_MAX {
        return Err(ParseError::Invalid(format!(
            "option {option} data of {len} bytes exceeds the limit of {OPTION_DATA_BYTES_MAX}"
        )));
    }
    Ok(OptionHeader { option, len })
}

/// The data of an INFO or GO option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Requested export name ("" = default export).
    pub name: String,
    /// Information types asked for (at most [`INFO_REQUESTS_MAX`] kept).
    pub requests: Vec<u16>,
}

/// Parses INFO/GO option data. Errors are answered with `NBD_REP_ERR_INVALID`.
pub fn parse_info_request(b: &[u8]) -> Result<InfoRequest, ParseError> {
    let name_len = be_u32(b, 0).ok_or_else(|| ParseError::Invalid("INFO/GO data shorter than 6 bytes".into()))?;
    let name_len = usize::try_from(name_len).map_err(|_| ParseError::Invalid("name length".into()))?;
    if name_len > NAME_BYTES_MAX {
        return Err(ParseError::Invalid(format!("export name of {name_len} bytes exceeds {NAME_BYTES_MAX}")));
    }
    let name_end = 4 + name_len;
    let name_bytes =
        b.get(4..name_end).ok_or_else(|| ParseError::Invalid(format!("name length {name_len} exceeds option data")))?;
    let name = parse_name(name_bytes)?;
    let count = be_u16(b, name_end).ok_or_else(|| ParseError::Invalid("INFO/GO data lacks request count".into()))?;
    let count = usize::from(count);
    let list = b.get(name_end + 2..).unwrap_or(&[]);
    if list.len() != count * 2 {
        return Err(ParseError::Invalid(format!(
            "INFO/GO lists {count} requests but carries {} bytes for them",
            list.len()
        )));
    }
    let requests = list.chunks_exact(2).take(INFO_REQUESTS_MAX).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
    Ok(InfoRequest { name, requests })
}

/// Parses an export name (EXPORT_NAME data or the name inside INFO/GO).
pub fn parse_name(b: &[u8]) -> Result<String, ParseError> {
    if b.len() > NAME_BYTES_MAX {
        return Err(ParseError::Invalid(format!("export name of {} bytes exceeds {NAME_BYTES_MAX}", b.len())));
    }
    let s = std::str::from_utf8(b).map_err(|e| ParseError::Invalid(format!("export name is not UTF-8: {e}")))?;
    if s.contains('\0') {
        return Err(ParseError::Invalid("export name contains NUL".into()));
    }
    Ok(s.to_owned())
}

/// One option reply: magic, option, reply type, length, data.
pub fn encode_option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    // Replies are built by the server from bounded pieces (names <= 4096 bytes).
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// `NBD_INFO_EXPORT` payload: type, size, transmission flags.
pub fn encode_info_export(size: u64, tflags: u16) -> Vec<u8> {
    let mut d = Vec::with_capacity(12);
    d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    d.extend_from_slice(&size.to_be_bytes());
    d.extend_from_slice(&tflags.to_be_bytes());
    d
}

/// `NBD_INFO_BLOCK_SIZE` payload: type, minimum, preferred, maximum.
pub fn encode_info_block_size() -> Vec<u8> {
    let mut d = Vec::with_capacity(14);
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    d.extend_from_slice(&MINIMUM_BLOCK_BYTES.to_be_bytes());
    d.extend_from_slice(&PREFERRED_BLOCK_BYTES.to_be_bytes());
    d.extend_from_slice(&REQUEST_BYTES_MAX.to_be_bytes());
    d
}

/// `NBD_INFO_NAME` / `NBD_INFO_DESCRIPTION` payload.
pub fn encode_info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(2 + s.len());
    d.extend_from_slice(&kind.to_be_bytes());
    d.extend_from_slice(s.as_bytes());
    d
}

/// `NBD_REP_SERVER` payload: name length, name.
pub fn encode_rep_server(name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    let len = u32::try_from(name.len()).unwrap_or(u32::MAX);
    d.extend_from_slice(&len.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, flags, and 124 zeros unless NO_ZEROES.
pub fn encode_export_name_reply(size: u64, tflags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut d = Vec::with_capacity(10 + 124);
    d.extend_from_slice(&size.to_be_bytes());
    d.extend_from_slice(&tflags.to_be_bytes());
    if !no_zeroes {
        d.extend_from_slice(&[0u8; 124]);
    }
    d
}

/// A transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// Opaque client cookie echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

/// Parses a 28-byte request header. Only a wrong magic or length is an error: after that
/// the stream cannot be trusted and the connection is closed.
pub fn parse_request(b: &[u8]) -> Result<Request, ParseError> {
    exact("request header", b, REQUEST_HEADER_BYTES)?;
    let magic = be_u32(b, 0).unwrap_or(0);
    if magic != REQUEST_MAGIC {
        return Err(ParseError::Magic { what: "request", got: u64::from(magic) });
    }
    Ok(Request {
        flags: be_u16(b, 4).unwrap_or(0),
        kind: be_u16(b, 6).unwrap_or(0),
        cookie: be_u64(b, 8).unwrap_or(0),
        offset: be_u64(b, 16).unwrap_or(0),
        len: be_u32(b, 24).unwrap_or(0),
    })
}

/// Encodes a request header (used by tests and the fuzz target's round trip).
pub fn encode_request(r: &Request) -> [u8; REQUEST_HEADER_BYTES] {
    let mut out = [0u8; REQUEST_HEADER_BYTES];
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&r.flags.to_be_bytes());
    out[6..8].copy_from_slice(&r.kind.to_be_bytes());
    out[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&r.offset.to_be_bytes());
    out[24..28].copy_from_slice(&r.len.to_be_bytes());
    out
}

/// A simple reply header.
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_BYTES];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// A structured reply chunk header: magic, flags, type, cookie, payload length.
pub fn encode_chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; STRUCTURED_REPLY_HEADER_BYTES] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_BYTES];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
    out
}

/// A complete final `NBD_REPLY_TYPE_ERROR` chunk (header and payload). The message is cut
/// to [`ERROR_MESSAGE_BYTES_MAX`] at a character boundary.
pub fn encode_error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let mut cut = message.len().min(ERROR_MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    let msg = message.get(..cut).unwrap_or("");
    let payload_len = 6 + msg.len();
    let mut out = Vec::with_capacity(STRUCTURED_REPLY_HEADER_BYTES + payload_len);
    out.extend_from_slice(&encode_chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, payload_len as u32));
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg.as_bytes());
    out
}

/// A complete final `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: `len` (non-zero) zeros at `offset`.
pub fn encode_hole_chunk(cookie: u64, offset: u64, len: u32) -> [u8; STRUCTURED_REPLY_HEADER_BYTES + 12] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_BYTES + 12];
    out[..20].copy_from_slice(&encode_chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, cookie, 12));
    out[20..28].copy_from_slice(&offset.to_be_bytes());
    out[28..32].copy_from_slice(&len.to_be_bytes());
    out
}

/// The header and offset of a final `NBD_REPLY_TYPE_OFFSET_DATA` chunk; `len` data bytes follow.
pub fn encode_data_chunk_prefix(cookie: u64, offset: u64, len: u32) -> [u8; STRUCTURED_REPLY_HEADER_BYTES + 8] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_BYTES + 8];
    // len <= REQUEST_BYTES_MAX, so len + 8 cannot overflow.
    out[..20].copy_from_slice(&encode_chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        len.saturating_add(8),
    ));
    out[20..28].copy_from_slice(&offset.to_be_bytes());
    out
}

/// What the export allows, as far as request validation is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    /// Export size in bytes.
    pub size: u64,
    /// Writes, trims and write-zeroes are refused with EPERM.
    pub read_only: bool,
    /// The client selected `base:allocation` (with structured replies): block status is
    /// answered; otherwise it is refused with EINVAL.
    pub block_status: bool,
}

/// A request the server will execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Read `len` bytes.
    Read {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
    },
    /// Write the `len`-byte payload that follows the header.
    Write {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Flush.
    Flush,
    /// Discard a range.
    Trim {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Write zeroes to a range.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Report the allocation of a range (`base:allocation`).
    BlockStatus {
        /// Byte offset.
        offset: u64,
        /// Length (non-zero).
        len: u32,
        /// One extent only, no longer than `len`.
        req_one: bool,
    },
}

/// The fate of a request, decided from its header alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Execute the command and reply.
    Execute(Command),
    /// Consume `skip` payload bytes, then reply with this NBD error.
    Reject {
        /// NBD error code.
        error: u32,
        /// Payload bytes that follow the header and must be read and dropped.
        skip: u32,
        /// Why, for the log.
        reason: String,
    },
    /// Soft disconnect: finish in-flight requests, then close.
    Disconnect,
    /// The stream cannot be kept in sync (e.g. an oversized write payload): close now.
    Close(String),
}

/// Decides what to do with a request. Pure: depends only on the header and the export.
pub fn classify_request(r: &Request, export: &ExportLimits) -> Disposition {
    let reject = |error: u32, skip: u32, reason: String| Disposition::Reject { error, skip, reason };
    let end = r.offset.checked_add(u64::from(r.len));
    let in_range = matches!(end, Some(e) if e <= export.size);
    let fua = r.flags & CMD_FLAG_FUA != 0;
    match r.kind {
        CMD_READ => {
            if r.flags != 0 {
                return reject(NBD_EINVAL, 0, format!("read with unsupported flags {:#x}", r.flags));
            }
            if r.len > REQUEST_BYTES_MAX {
                return reject(NBD_EINVAL, 0, format!("read of {} bytes exceeds {REQUEST_BYTES_MAX}", r.len));
            }
            if !in_range {
                return reject(
                    NBD_EINVAL,
                    0,
                    format!("read {}+{} beyond export size {}", r.offset, r.len, export.size),
                );
            }
            Disposition::Execute(Command::Read { offset: r.offset, len: r.len })
        }
        CMD_WRITE => {
            // The payload follows regardless of what we think of the request; one larger
            // than we will buffer cannot be skipped cheaply, so the connection goes.
            if r.len > REQUEST_BYTES_MAX {
                return Disposition::Close(format!("write payload of {} bytes exceeds {REQUEST_BYTES_MAX}", r.len));
            }
            if r.flags & !CMD_FLAG_FUA != 0 {
                return reject(NBD_EINVAL, r.len, format!("write with unsupported flags {:#x}", r.flags));
            }
            if export.read_only {
                return reject(NBD_EPERM, r.len, "write to a read-only export".into());
            }
            if !in_range {
                return reject(
                    NBD_ENOSPC,
                    r.len,
                    format!("write {}+{} beyond export size {}", r.offset, r.len, export.size),
                );
            }
            Disposition::Execute(Command::Write { offset: r.offset, len: r.len, fua })
        }
        CMD_DISC => Disposition::Disconnect,
        CMD_FLUSH => {
            if r.flags != 0 {
                return reject(NBD_EINVAL, 0, format!("flush with unsupported flags {:#x}", r.flags));
            }
            Disposition::Execute(Command::Flush)
        }
        CMD_TRIM => {
            if r.flags & !CMD_FLAG_FUA != 0 {
                return reject(NBD_EINVAL, 0, format!("trim with unsupported flags {:#x}", r.flags));
            }
            if export.read_only {
                return reject(NBD_EPERM, 0, "trim on a read-only export".into());
            }
            if !in_range {
                return reject(
                    NBD_EINVAL,
                    0,
                    format!("trim {}+{} beyond export size {}", r.offset, r.len, export.size),
                );
            }
            Disposition::Execute(Command::Trim { offset: r.offset, len: r.len, fua })
        }
        CMD_WRITE_ZEROES => {
            if r.flags & !(CMD_FLAG_FUA | CMD_FLAG_NO_HOLE) != 0 {
                return reject(NBD_EINVAL, 0, format!("write-zeroes with unsupported flags {:#x}", r.flags));
            }
            if export.read_only {
                return reject(NBD_EPERM, 0, "write-zeroes on a read-only export".into());
            }
            if !in_range {
                return reject(
                    NBD_ENOSPC,
                    0,
                    format!("write-zeroes {}+{} beyond export size {}", r.offset, r.len, export.size),
                );
            }
            // NO_HOLE asks for allocated zeros; the engine stores zero blocks as holes,
            // which read back identically, and the spec lets a server ignore allocation.
            Disposition::Execute(Command::WriteZeroes { offset: r.offset, len: r.len, fua })
        }
        crate::block_status::CMD_BLOCK_STATUS => {
            use crate::block_status::CMD_FLAG_REQ_ONE;
            if !export.block_status {
                return reject(
                    NBD_EINVAL,
                    0,
                    "block status without a selected metadata context (negotiate base:allocation first)".into(),
                );
            }
            if r.flags & !CMD_FLAG_REQ_ONE != 0 {
                return reject(NBD_EINVAL, 0, format!("block status with unsupported flags {:#x}", r.flags));
            }
            if r.len == 0 {
                return reject(NBD_EINVAL, 0, "block status of zero length".into());
            }
            if !in_range {
                return reject(
                    NBD_EINVAL,
                    0,
                    format!("block status {}+{} beyond export size {}", r.offset, r.len, export.size),
                );
            }
            Disposition::Execute(Command::BlockStatus {
                offset: r.offset,
                len: r.len,
                req_one: r.flags & CMD_FLAG_REQ_ONE != 0,
            })
        }
        other => reject(NBD_EINVAL, 0, format!("unknown command {other}")),
    }
}

/// Maps a host errno (from the engine) to the NBD error code the spec allows.
pub fn nbd_error_from_errno(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => NBD_EPERM,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPORT: ExportLimits = ExportLimits { size: 1 << 20, read_only: false, block_status: true };

    fn req(kind: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request { flags, kind, cookie: 7, offset, len }
    }

    #[test]
    fn request_round_trips() {
        let r = req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512);
        assert_eq!(parse_request(&encode_request(&r)), Ok(r));
    }

    #[test]
    fn bad_magic_is_an_error() {
        let mut b = encode_request(&req(CMD_READ, 0, 0, 1));
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Err(ParseError::Magic { .. })));
        assert!(parse_request(&b[..27]).is_err());
    }

    #[test]
    fn classify_covers_the_error_table() {
        let ro = ExportLimits { read_only: true, ..EXPORT };
        assert_eq!(
            classify_request(&req(CMD_READ, 0, 0, 4096), &EXPORT),
            Disposition::Execute(Command::Read { offset: 0, len: 4096 })
        );
        let err = |d: Disposition| match d {
            Disposition::Reject { error, skip, .. } => (error, skip),
            other => panic!("expected a reject, got {other:?}"),
        };
        assert_eq!(err(classify_request(&req(CMD_READ, 0, (1 << 20) - 1, 2), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_READ, 0, u64::MAX, 2), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_WRITE, 0, 1 << 20, 4), &EXPORT)), (NBD_ENOSPC, 4));
        assert_eq!(err(classify_request(&req(CMD_WRITE, 0, 0, 4), &ro)), (NBD_EPERM, 4));
        assert_eq!(err(classify_request(&req(CMD_TRIM, 0, 0, 4), &ro)), (NBD_EPERM, 0));
        assert_eq!(err(classify_request(&req(CMD_WRITE_ZEROES, 0, 0, 4), &ro)), (NBD_EPERM, 0));
        assert_eq!(err(classify_request(&req(CMD_WRITE, 1 << 4, 0, 4), &EXPORT)), (NBD_EINVAL, 4));
        assert_eq!(err(classify_request(&req(99, 0, 0, 0), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_READ, 0, 0, REQUEST_BYTES_MAX + 1), &EXPORT)), (NBD_EINVAL, 0));
        assert!(matches!(
            classify_request(&req(CMD_WRITE, 0, 0, REQUEST_BYTES_MAX + 1), &EXPORT),
            Disposition::Close(_)
        ));
        assert_eq!(classify_request(&req(CMD_DISC, 0, 0, 0), &EXPORT), Disposition::Disconnect);
        use crate::block_status::{CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE};
        let unnegotiated = ExportLimits { block_status: false, ..EXPORT };
        assert_eq!(err(classify_request(&req(CMD_BLOCK_STATUS, 0, 0, 4096), &unnegotiated)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_BLOCK_STATUS, 0, 0, 0), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_BLOCK_STATUS, CMD_FLAG_FUA, 0, 1), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(err(classify_request(&req(CMD_BLOCK_STATUS, 0, 1 << 20, 1), &EXPORT)), (NBD_EINVAL, 0));
        assert_eq!(
            classify_request(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4096, 512), &ro),
            Disposition::Execute(Command::BlockStatus { offset: 4096, len: 512, req_one: true })
        );
        assert_eq!(
            classify_request(&req(CMD_WRITE_ZEROES, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE, 0, 8), &EXPORT),
            Disposition::Execute(Command::WriteZeroes { offset: 0, len: 8, fua: true })
        );
    }

    #[test]
    fn info_request_parses_and_rejects_inconsistent_lengths() {
        let mut b = Vec::new();
        b.extend_from_slice(&3u32.to_be_bytes());
        b.extend_from_slice(b"vol");
        b.extend_from_slice(&2u16.to_be_bytes());
        b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        b.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(
            parse_info_request(&b),
            Ok(InfoRequest { name: "vol".into(), requests: vec![INFO_BLOCK_SIZE, INFO_NAME] })
        );
        assert!(parse_info_request(&b[..b.len() - 1]).is_err());
        let mut long = b.clone();
        long[3] = 200;
        assert!(parse_info_request(&long).is_err());
        assert!(parse_info_request(&[]).is_err());
    }

    #[test]
    fn error_chunk_message_is_bounded_and_cut_at_a_char_boundary() {
        let msg = "é".repeat(ERROR_MESSAGE_BYTES_MAX);
        let c = encode_error_chunk(9, NBD_EIO, &msg);
        let payload_len = u32::from_be_bytes([c[16], c[17], c[18], c[19]]) as usize;
        assert_eq!(c.len(), STRUCTURED_REPLY_HEADER_BYTES + payload_len);
        let msg_len = u16::from_be_bytes([c[24], c[25]]) as usize;
        assert!(msg_len <= ERROR_MESSAGE_BYTES_MAX && payload_len == 6 + msg_len);
        assert!(std::str::from_utf8(&c[26..]).is_ok());
    }

    #[test]
    fn client_flags_reject_unknown_bits() {
        assert_eq!(parse_client_flags(&3u32.to_be_bytes()), Ok(ClientFlags { fixed_newstyle: true, no_zeroes: true }));
        assert!(parse_client_flags(&4u32.to_be_bytes()).is_err());
    }

    #[test]
    fn option_header_bounds_length() {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&(OPTION_DATA_BYTES_MAX + 1).to_be_bytes());
        assert!(parse_option_header(&b).is_err());
        b[12..16].copy_from_slice(&10u32.to_be_bytes());
        assert_eq!(parse_option_header(&b), Ok(OptionHeader { option: OPT_GO, len: 10 }));
    }
}
