//! `dedupvol serve`: export one volume over NBD (see docs/nbd.md).
//!
//! One volume per process: the volume is opened once and shared by every connection,
//! which is what lets the server advertise multi-conn. To serve several volumes, run
//! several processes on different ports or sockets.
//!
//! Beside the NBD listener it runs the admin socket (`dedupvol stats` on a served volume
//! asks it; see `admin`) and, with `--metrics`, an OpenMetrics endpoint (see `metrics`).
//!
//! Shutdown: SIGINT/SIGTERM/SIGHUP stop accepting, in-flight requests finish and are
//! answered (a client that stopped reading is not waited for), then the volume is closed
//! cleanly (flushed, marked clean). A second signal exits at once.

use anyhow::Context;
use clap::Subcommand;
use dedupvol_core::{IoMode, OpenOptions, Volume, WritePolicy};
use dedupvol_nbd::{Backend, ConnectionLimits, ExportConfig, ListenAddr, MemBackend, RunSummary, Server, ServerConfig};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Default listening address (the IANA NBD port on loopback only).
const LISTEN_DEFAULT: &str = "127.0.0.1:10809";
/// Default bound on concurrent client connections.
const CONNECTIONS_MAX_DEFAULT: usize = 16;

#[derive(Subcommand)]
pub enum ServeCommand {
    /// Serve a volume over NBD (one volume per process; see docs/nbd.md).
    Serve {
        /// The volume's data device or file.
        path: PathBuf,
        /// TCP address to listen on (HOST:PORT; port 0 picks a free port, printed on start).
        #[arg(long, default_value = LISTEN_DEFAULT)]
        listen: String,
        /// Listen on this Unix-domain socket instead of TCP.
        #[arg(long, conflicts_with = "listen")]
        socket: Option<PathBuf>,
        /// Export name clients ask for (the empty default name is accepted too).
        #[arg(long, default_value = "dedupvol")]
        export_name: String,
        /// Refuse writes (EPERM) and open the volume read-only.
        #[arg(long)]
        read_only: bool,
        /// Most client connections served at once; a client beyond them is answered with an
        /// NBD error saying so, then closed.
        #[arg(long, default_value_t = CONNECTIONS_MAX_DEFAULT)]
        connections_max: usize,
        /// Separate metadata device, when the volume was formatted with one.
        #[arg(long)]
        meta_device: Option<PathBuf>,
        /// Override the volume's write policy: sync (durable before ack) or async.
        #[arg(long)]
        write_policy: Option<WritePolicy>,
        /// Device I/O: auto (direct for a hash-verified volume, buffered for a byte-verified
        /// one), direct (O_DIRECT where supported; the engine's content cache is the only
        /// data cache), buffered (through the kernel page cache) or read-cached (writes
        /// direct, data reads through the page cache).
        #[arg(long, default_value = "auto")]
        io: IoMode,
        /// Memory for the content cache: the engine's read cache of physical blocks, the
        /// only data cache under direct I/O (K/M/G suffixes), or auto: a quarter of the
        /// memory this process may use (the machine's, or its memory cgroup's limit).
        #[arg(long, default_value = "auto")]
        cache_size: String,
        /// Memory for the fingerprint index in this session (default: the size chosen at
        /// format); a smaller one opens the volume on a machine with less memory.
        #[arg(long)]
        index_memory: Option<String>,
        /// Whether newly written blocks enter the content cache: on (the default for a
        /// server: under direct I/O it is the only cache that can answer a client re-reading
        /// what it just wrote), off (filled by reads only: faster writes, colder re-reads),
        /// or auto (the library's choice: on for byte verification, off for hash).
        #[arg(long, default_value = "on", value_parser = ["auto", "on", "off"])]
        cache_writes: String,
        #[command(flatten)]
        tier: crate::volume_cmds::TierArgs,
        /// Write-once journaling: auto finds the journal of an ext3/ext4 file system on the
        /// volume (whole disk, or inside MBR/GPT partitions; looked for again whenever a
        /// superblock is rewritten) and shares each checkpoint write with its journal copy
        /// after comparing the bytes (no data written, no BLAKE3, no index: see
        /// docs/design.md); OFFSET:LENGTH names the journal's byte range (an external
        /// journal); off turns it off.
        #[arg(long, default_value = "off", value_name = "auto|off|OFFSET:LENGTH")]
        woj: dedupvol_core::WojMode,
        /// Worker threads per connection (requests executed concurrently per client; each
        /// reads its own request, so none is handed between threads). On a 2-core machine
        /// 16 workers served random 4 KiB reads slower than 4 and doubled the server's
        /// memory; more may pay on more cores.
        #[arg(long, default_value_t = 4)]
        workers_per_connection: usize,
        /// Serve OpenMetrics (Prometheus) text at http://ADDR/metrics (HOST:PORT; port 0
        /// picks a free port, printed on start). Loopback unless you mean it: no TLS, no
        /// authentication.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<String>,
        /// Serve a RAM disk of this size instead of the volume (protocol testing only;
        /// PATH is ignored and nothing is stored).
        #[arg(long, hide = true)]
        in_memory: Option<String>,
    },
}

impl ServeCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        let ServeCommand::Serve {
            path,
            listen,
            socket,
            export_name,
            read_only,
            connections_max,
            meta_device,
            write_policy,
            io,
            cache_size,
            index_memory,
            cache_writes,
            tier,
            woj,
            workers_per_connection,
            metrics,
            in_memory,
        } = self;
        if connections_max == 0 {
            usage_bail!("--connections-max must be at least 1");
        }
        if !(1..=64).contains(&workers_per_connection) {
            usage_bail!("--workers-per-connection must be between 1 and 64");
        }
        if export_name.len() > dedupvol_nbd::proto::NAME_BYTES_MAX {
            usage_bail!("--export-name is longer than {} bytes", dedupvol_nbd::proto::NAME_BYTES_MAX);
        }

        // Open the volume (replaying its journal if needed) before listening, so a client
        // never connects to a server that then fails to open.
        let (volume, backend): (Option<Arc<Volume>>, Arc<dyn Backend>) = match &in_memory {
            Some(size) => {
                let size =
                    dedupvol_core::parse_size(size).map_err(|e| crate::usage(format!("--in-memory {size}: {e}")))?;
                (None, Arc::new(MemBackend::new(size, read_only).map_err(|e| anyhow::anyhow!("{e}"))?))
            }
            None => {
                // The engine's FileStorage holds an flock (exclusive read-write, shared
                // read-only) for as long as the volume is open.
                let content_cache_bytes = if cache_size == "auto" {
                    let b = crate::memory::auto_cache_bytes();
                    // Not eprintln!: a closed stderr must not stop the server.
                    let _ = writeln!(std::io::stderr(), "dedupvol: content cache {} MiB (--cache-size auto)", b >> 20);
                    b
                } else {
                    dedupvol_core::parse_size(&cache_size)
                        .map_err(|e| crate::usage(format!("--cache-size {cache_size}: {e}")))?
                };
                let cache_writes = match cache_writes.as_str() {
                    "on" => Some(true),
                    "off" => Some(false),
                    _ => None,
                };
                let index_memory_bytes =
                    index_memory.as_deref().map(dedupvol_core::parse_size).transpose().context("--index-memory")?;
                let opts = OpenOptions {
                    read_only,
                    write_policy,
                    io_mode: io,
                    content_cache_bytes,
                    cache_writes,
                    index_memory_bytes,
                    tier: tier.options(),
                    woj,
                    ..Default::default()
                };
                // open_path finds a separate metadata device from the superblock unless
                // --meta-device overrides it, and replays the journal after a crash.
                let v = Volume::open_path(&path, meta_device.as_deref(), &opts)
                    .with_context(|| format!("opening volume {}", path.display()))?;
                crate::volume_cmds::warn_tier_notes(&v);
                let v = Arc::new(v);
                (Some(v.clone()), v)
            }
        };

        let addr = match socket {
            Some(p) => ListenAddr::Unix(p),
            None => ListenAddr::Tcp(listen),
        };
        let config = ServerConfig {
            export: ExportConfig {
                name: export_name,
                description: Some(format!("dedupvol volume {}", path.display())),
                read_only,
            },
            connections_max,
            limits: ConnectionLimits { workers: workers_per_connection, ..Default::default() },
        };
        // Whatever happens to the server, the volume is closed cleanly afterwards: dropping
        // it unclosed would look like a crash and cost a journal replay at the next open.
        let side = SideServices { volume_path: path.clone(), volume: volume.clone(), metrics_addr: metrics };
        let served = serve(&addr, config, backend, side);
        let mut tier_stats = None;
        let mut woj_stats = None;
        let closed = match volume {
            Some(v) => match Arc::try_unwrap(v) {
                Ok(v) => {
                    let st = v.stats();
                    tier_stats = st.tier;
                    woj_stats = st.woj;
                    v.close().with_context(|| format!("closing volume {}", path.display()))
                }
                Err(_) => Err(anyhow::anyhow!("volume still referenced after the server stopped; not closed")),
            },
            None => Ok(()),
        };
        let summary = served?;
        closed?;
        // Not eprintln!: a stderr nobody reads any more must not turn a clean stop into a panic.
        let _ = writeln!(
            std::io::stderr(),
            "dedupvol: stopped after {} connection(s) ({} refused); volume closed",
            summary.connections_served,
            summary.connections_refused
        );
        if let Some(w) = woj_stats {
            for l in crate::volume_cmds::woj_summary(&w) {
                let _ = writeln!(std::io::stderr(), "dedupvol: {l}");
            }
        }
        if let Some(t) = tier_stats {
            let _ = writeln!(std::io::stderr(), "dedupvol: {}", crate::volume_cmds::tier_summary(&t));
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// What runs beside the NBD server: the admin socket (always, for a volume) and the
/// metrics endpoint (with `--metrics`).
struct SideServices {
    volume_path: PathBuf,
    volume: Option<Arc<Volume>>,
    metrics_addr: Option<String>,
}

/// Binds, starts the admin socket and metrics endpoint, prints the readiness line, and
/// serves until SIGINT/SIGTERM/SIGHUP. Consumes `backend` and `side` so that, on return
/// (the side services stopped and joined), the caller holds the only reference to the volume.
fn serve(
    addr: &ListenAddr,
    config: ServerConfig,
    backend: Arc<dyn Backend>,
    side: SideServices,
) -> anyhow::Result<RunSummary> {
    let name = config.export.name.clone();
    let server = Server::bind(addr, config).with_context(|| format!("listening on {addr}"))?;
    server.stop_on_signals().context("installing signal handlers")?;
    let size = backend.size();
    let source = crate::admin::Source {
        volume: side.volume,
        metrics: server.metrics(),
        export: name.clone(),
        address: server.display_addr(),
        started: std::time::Instant::now(),
    };
    // Started before the readiness line, so a script that waited for it finds them.
    let metrics_service = match &side.metrics_addr {
        Some(a) => Some(crate::metrics::start(a, source.clone()).with_context(|| format!("--metrics {a}"))?),
        None => None,
    };
    // Without its admin socket the server still serves; `stats` then cannot reach it.
    let admin = match source.volume {
        Some(_) => crate::admin::start(&side.volume_path, source).unwrap_or_else(|e| {
            let _ = writeln!(std::io::stderr(), "dedupvol: warning: no admin socket: {}", crate::error_line(&e));
            None
        }),
        None => None,
    };
    // A reader that closed our stdout after the readiness line does not stop the server.
    outln!("dedupvol: serving {name} ({size} bytes) on {}", server.display_addr())?;
    // After the readiness line, which stays the first line scripts wait for.
    if let Some(m) = &metrics_service {
        outln!("dedupvol: metrics on http://{}/metrics", m.address())?;
    }
    let summary = server.run(backend).context("serving");
    // Stopped before the volume is closed: they hold it.
    if let Some(a) = admin {
        a.stop();
    }
    if let Some(m) = metrics_service {
        m.stop();
    }
    summary
}
