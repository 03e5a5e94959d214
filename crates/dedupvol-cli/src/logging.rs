//! The server's log: one line per event on stderr, `TIMESTAMP LEVEL dedupvol: message`,
//! written through `tracing` (the NBD crate logs its connections and failures there too).
//!
//! `DEDUPVOL_LOG` sets the level (`error`, `warn`, `info` — the default —, `debug`,
//! `trace`). Command output (tables, summaries, the readiness line) is not logging and
//! stays on stdout.
//!
//! Invariants:
//! - Writing a line never fails the caller: a closed or full stderr drops the line.

use std::fmt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Environment variable naming the log level.
pub const LOG_LEVEL_ENV: &str = "DEDUPVOL_LOG";

/// `TIMESTAMP LEVEL dedupvol: message`.
struct Line;

impl<S, N> FormatEvent<S, N> for Line
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        SystemTime.format_time(&mut w)?;
        write!(w, " {:>5} dedupvol: ", event.metadata().level())?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// Stderr that reports every write as done. Why: tracing-subscriber reports a failed
/// write with `eprintln!`, which panics on a closed stderr (`dedupvol serve 2>&1 | head
/// -1`) and would kill the server; a log line nobody can read is simply dropped.
struct Lossy(std::io::Stderr);

impl std::io::Write for Lossy {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.write_all(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let _ = self.0.flush();
        Ok(())
    }
}

/// The level `DEDUPVOL_LOG` asks for (info when unset); an unknown value is a usage error.
fn level() -> anyhow::Result<Level> {
    match std::env::var(LOG_LEVEL_ENV) {
        Err(_) => Ok(Level::INFO),
        Ok(v) => v
            .parse::<Level>()
            .map_err(|_| crate::usage(format!("{LOG_LEVEL_ENV}={v}: expected error, warn, info, debug or trace"))),
    }
}

/// Installs the log writer for this process (once; a second call changes nothing).
pub fn init() -> anyhow::Result<()> {
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level()?)
        .with_writer(|| Lossy(std::io::stderr()))
        .event_format(Line)
        .finish();
    // Already installed (a second server in one test process): keep the first.
    let _ = tracing::subscriber::set_global_default(subscriber);
    Ok(())
}
