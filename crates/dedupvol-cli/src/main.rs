//! The `dedupvol` command-line tool: format, inspect, check, import/export, serve and
//! benchmark volumes, and generate and replay block traces.
//!
//! Exit codes, the same in every subcommand: 0 success; 1 the operation failed; 2 the
//! command line is wrong (clap's own errors, and [`UsageError`] for what clap cannot see).
//! `check` has its own codes on top of these (see its help).
//!
//! Output: everything on stdout goes through [`outln!`]/[`out!`]. A closed stdout (the
//! reader of a pipe left, as `head` does) is not an error: further output is dropped and
//! the command finishes its work and exits as it would have. Why not `SIGPIPE`'s default
//! action, as C tools do: it would kill `import` or `check --repair` between printing and
//! closing the volume (costing a journal replay), and `serve`, whose client sockets must
//! never raise it.

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// Exit code of a usage error (clap's, and sysexits' EX_USAGE family).
pub const EXIT_USAGE: u8 = 2;

/// Prints to stdout like `print!`; returns `io::Result<()>`, where a closed stdout is `Ok`.
macro_rules! out {
    ($($t:tt)*) => { $crate::write_stdout(format_args!($($t)*)) };
}

/// Prints a line to stdout like `println!`; returns `io::Result<()>`, where a closed stdout
/// is `Ok`.
macro_rules! outln {
    () => { $crate::write_stdout(format_args!("\n")) };
    ($($t:tt)*) => { $crate::write_stdout(format_args!("{}\n", format_args!($($t)*))) };
}

/// Set once stdout turned out to be closed: later output is dropped.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes to stdout and flushes (so a closed pipe is seen here, not in a panic at exit).
pub fn write_stdout(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut o = std::io::stdout().lock();
    match o.write_fmt(args).and_then(|()| o.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        r => r,
    }
}

/// A reduction ratio as users read it: "2.50:1", or "-" when there is none (nothing stored
/// yet, or only zeros), never a misleading "0.00".
pub fn ratio_text(ratio: f64) -> String {
    if ratio.is_finite() && ratio > 0.0 {
        format!("{ratio:.2}:1")
    } else {
        "-".into()
    }
}

/// A command-line mistake clap cannot catch (a value's meaning, a combination of flags):
/// exits with [`EXIT_USAGE`] like clap's own errors.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A [`UsageError`] as an `anyhow::Error`.
pub fn usage(message: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.to_string()))
}

/// Returns a [`UsageError`] from the enclosing function (like `anyhow::bail!`).
macro_rules! usage_bail {
    ($($t:tt)*) => { return Err($crate::usage(format!($($t)*))) };
}

mod admin;
mod affinity;
mod alloc;
mod copy;
mod grow_cmd;
mod interrupt;
mod logging;
mod memory;
mod metrics;
mod model_cmd;
mod probe;
mod replay;
mod scale_bench;
mod scrub_cmd;
mod serve;
mod serve_config;
mod service;
mod stats_cmd;
mod stripe_bench;
mod trace_cmds;
mod tune_cmd;
mod volume_cmds;
mod woj_bench;
mod workload_cmds;

#[derive(Parser)]
#[command(name = "dedupvol", version, about = "Inline dedup + compression block storage engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Volume(volume_cmds::VolumeCommand),
    #[command(flatten)]
    Serve(serve::ServeCommand),
    #[command(flatten)]
    Workload(workload_cmds::WorkloadCommand),
    #[command(flatten)]
    Trace(trace_cmds::TraceCommand),
    /// Size a server before buying it: throughput bound and cost of cores × SSDs (with or
    /// without an NVDIMM, or a RADOS pool) from this machine's per-core rates.
    #[command(long_about = model_cmd::MODEL_LONG_ABOUT)]
    Model(model_cmd::ModelArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write man pages: dedupvol(1) and one per subcommand (dedupvol-serve(1), ...) into
    /// DIR, or dedupvol(1) alone on stdout.
    Man {
        /// Directory to write the pages into (created if missing).
        #[arg(long, value_name = "DIR")]
        out_dir: Option<std::path::PathBuf>,
    },
}

/// `dedupvol completions SHELL`.
fn completions(shell: clap_complete::Shell) -> anyhow::Result<ExitCode> {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "dedupvol", &mut out);
    out!("{}", String::from_utf8_lossy(&out))?;
    Ok(ExitCode::SUCCESS)
}

/// `dedupvol man [--out-dir DIR]`.
fn man_pages(out_dir: Option<std::path::PathBuf>) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    use clap::CommandFactory;
    let cmd = Cli::command();
    let Some(dir) = out_dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut page)?;
        out!("{}", String::from_utf8_lossy(&page))?;
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    let mut pages = vec![(String::from("dedupvol"), cmd.clone())];
    for sub in cmd.get_subcommands() {
        let name = format!("dedupvol-{}", sub.get_name());
        pages.push((name.clone(), sub.clone().name(name)));
    }
    for (name, c) in pages {
        let mut page = Vec::new();
        clap_mangen::Man::new(c).render(&mut page)?;
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    outln!("wrote {} man pages to {}", written.len(), dir.display())?;
    Ok(ExitCode::SUCCESS)
}

/// The error and its causes on one line, each cause once: many errors (the engine's I/O
/// errors among them) already end with their source's text, which `{:#}` would repeat
/// ("…: No such file or directory (os error 2): No such file or directory (os error 2)").
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// glibc malloc arenas the process may use: what C libraries (zstd's contexts) allocate
/// still comes from glibc; Rust's allocations come from `alloc::Allocator`. Why two: the
/// content cache's 4 KiB blocks, when glibc served them, were allocated and freed on every
/// worker thread, and with glibc's default (8 per core) each thread's arena kept its own
/// freed memory: a server with a 1 GiB cache grew to 2.2 GiB under mixed reads and writes
/// (1.44 GiB after 8 s of random 4 KiB reads and writes, 1.25 GiB with two arenas).
const MALLOC_ARENAS_MAX: libc::c_int = 2;

#[global_allocator]
static GLOBAL: alloc::Allocator = alloc::Allocator;

fn main() -> ExitCode {
    // SAFETY: mallopt only sets an allocator parameter; called before any thread exists.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS_MAX) };
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Volume(c) => c.run(),
        Command::Serve(c) => c.run(),
        Command::Workload(c) => c.run(),
        Command::Trace(c) => c.run(),
        Command::Model(c) => c.run(),
        Command::Completions { shell } => completions(shell),
        Command::Man { out_dir } => man_pages(out_dir),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let usage = e.chain().any(|c| c.is::<UsageError>());
            // A closed stderr must not turn an error into a panic.
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "dedupvol: error: {}", error_line(&e));
            if usage {
                let _ = writeln!(err, "For more information, try '--help'.");
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_os_error_already_in_the_message_is_not_repeated() {
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let inner = dedupvol_core::Error::io("opening v.img", io);
        let e = anyhow::Error::new(inner).context("opening volume v.img");
        let line = error_line(&e);
        assert_eq!(line.matches("os error 2").count(), 1, "{line}");
        assert!(line.starts_with("opening volume v.img: I/O error: opening v.img: "), "{line}");
    }

    #[test]
    fn usage_errors_are_found_under_context() {
        let e = usage("--threads 0 must be between 1 and 256").context("bench");
        assert!(e.chain().any(|c| c.is::<UsageError>()));
    }
}
