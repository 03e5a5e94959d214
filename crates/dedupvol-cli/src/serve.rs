//! `dedupvol serve`: export volumes over NBD (see docs/nbd.md).
//!
//! One process serves one or more volumes, each an export chosen by name (`serve A.img
//! B.img`, `NAME=PATH`, or a TOML file with `--config`, see [`crate::serve_config`]). Each
//! volume is opened once and shared by every connection that selects it, which is what
//! lets the server advertise multi-conn; all of them share the process's reduction thread
//! pool and the content-cache budget (split evenly).
//!
//! Beside the NBD listener it runs an admin socket per volume (`dedupvol stats` on a
//! served volume asks it; see `admin`) and, with `--metrics`, one OpenMetrics endpoint for
//! all exports (see `metrics`). TLS (`--tls-cert`, `--tls-key`) is offered with
//! `NBD_OPT_STARTTLS` and required by default; listening beyond loopback without it is
//! refused unless `--insecure`.
//!
//! Shutdown: SIGINT/SIGTERM/SIGHUP stop accepting, in-flight requests finish and are
//! answered (a client that stopped reading is not waited for), then every volume is
//! closed cleanly (flushed, marked clean). A second signal exits at once.

use crate::serve_config::{ExportSpec, ServeFile, TlsMode};
use anyhow::Context;
use clap::Subcommand;
use dedupvol_core::{IoMode, OpenOptions, Volume, WritePolicy};
use dedupvol_nbd::{
    Backend, ConnectionLimits, Export, ExportConfig, ListenAddr, MemBackend, RunSummary, Server, ServerConfig, TlsFiles,
};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Default listening address (the IANA NBD port on loopback only).
const LISTEN_DEFAULT: &str = "127.0.0.1:10809";
/// Default bound on concurrent client connections.
const CONNECTIONS_MAX_DEFAULT: usize = 16;
/// Export name of a server of one volume, unless `--export-name` or `NAME=PATH` names it.
const SINGLE_EXPORT_NAME: &str = "dedupvol";

#[derive(Subcommand)]
pub enum ServeCommand {
    /// Serve volumes over NBD (see docs/nbd.md).
    Serve {
        /// Volumes to serve, each `PATH` or `NAME=PATH` (the volume's data device or file).
        /// One volume is exported as "dedupvol" unless named; several under their file names
        /// without extension. The empty export name selects the first.
        #[arg(value_name = "VOLUME")]
        volumes: Vec<String>,
        /// A TOML file describing the server and its exports (docs/nbd.md shows the keys);
        /// options given on the command line take precedence over it.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// TCP address to listen on (HOST:PORT; port 0 picks a free port, printed on start;
        /// default 127.0.0.1:10809).
        #[arg(long)]
        listen: Option<String>,
        /// Listen on this Unix-domain socket instead of TCP.
        #[arg(long, conflicts_with = "listen")]
        socket: Option<PathBuf>,
        /// Export name of a single volume (default "dedupvol").
        #[arg(long)]
        export_name: Option<String>,
        /// Refuse writes (EPERM) and open every volume read-only.
        #[arg(long)]
        read_only: bool,
        /// Serve this export read-only (repeatable; the others stay writable).
        #[arg(long, value_name = "NAME")]
        read_only_export: Vec<String>,
        /// Most client connections served at once, all exports together; a client beyond
        /// them is answered with an NBD error saying so, then closed.
        #[arg(long)]
        connections_max: Option<usize>,
        /// Separate metadata device, when the volume was formatted with one (one volume
        /// only; a config file names one per export).
        #[arg(long)]
        meta_device: Option<PathBuf>,
        /// Take over volumes in RADOS (rados://POOL/NAME) that another server holds: fence
        /// it (its client address is blocklisted, so nothing it still sends lands), break its
        /// lock, replay the journal and serve. For a server taking over from a dead one.
        #[arg(long)]
        take_over: bool,
        /// Override the volumes' write policy: sync (durable before ack) or async.
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
        /// Several volumes share it evenly.
        #[arg(long)]
        cache_size: Option<String>,
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
        /// Deferred compression: when the writes waiting for compression would keep the
        /// compression workers busy longer than this many microseconds, the excess is
        /// compressed with LZ4 instead of zstd, so clients do not wait for compression; the
        /// volume's cleaner recompresses it with zstd when the volume is idle. 0 (the
        /// default) never defers.
        #[arg(long, default_value_t = 0, value_name = "MICROSECONDS")]
        defer_compression_us: u64,
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
        /// PEM certificate chain of the server: offers TLS (NBD STARTTLS) to clients.
        #[arg(long, value_name = "FILE", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of the server's certificate.
        #[arg(long, value_name = "FILE", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// PEM CA certificates client certificates must chain to (clients then must
        /// present one).
        #[arg(long, value_name = "FILE", requires = "tls_cert")]
        tls_client_ca: Option<PathBuf>,
        /// Client certificate name (subject CN or DNS name) allowed in (repeatable; needs a
        /// client CA). Without it, any client the CA signed is allowed.
        #[arg(long, value_name = "NAME", requires = "tls_client_ca")]
        tls_allow: Vec<String>,
        /// require (the default with a certificate): clients must upgrade to TLS before
        /// anything else; on: TLS offered, plain clients accepted too (loopback only).
        #[arg(long, value_parser = ["require", "on"])]
        tls: Option<String>,
        /// Serve without TLS on a non-loopback address (a trusted network only: clients
        /// and data are then neither authenticated nor encrypted).
        #[arg(long)]
        insecure: bool,
        /// Serve a RAM disk of this size instead of the volume (protocol testing only;
        /// PATH is ignored and nothing is stored).
        #[arg(long, hide = true)]
        in_memory: Option<String>,
    },
}

/// One export being served: its volume (None for a RAM disk) and where it came from.
struct Served {
    spec: ExportSpec,
    volume: Option<Arc<Volume>>,
    export: Export,
    /// The volume's cleaner thread (read-write volumes), stopped before the close.
    cleaner: Option<dedupvol_core::Cleaner>,
}

/// How often a served volume's cleaner looks at its dead-space hint, and the hint that
/// starts a pass.
const CLEANER_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);
/// See `CLEANER_INTERVAL`.
const CLEANER_TRIGGER_BYTES: u64 = 16 << 20;

impl ServeCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        let ServeCommand::Serve {
            volumes,
            config,
            listen,
            socket,
            export_name,
            read_only,
            read_only_export,
            connections_max,
            meta_device,
            take_over,
            write_policy,
            io,
            cache_size,
            index_memory,
            cache_writes,
            tier,
            woj,
            defer_compression_us,
            workers_per_connection,
            metrics,
            tls_cert,
            tls_key,
            tls_client_ca,
            tls_allow,
            tls,
            insecure,
            in_memory,
        } = self;
        crate::logging::init()?;
        let file = match &config {
            Some(p) => ServeFile::load(p)?,
            None => ServeFile::default(),
        };
        let mut specs = file.exports.clone();
        for v in &volumes {
            specs.push(ExportSpec::parse(v)?);
        }
        if specs.is_empty() {
            usage_bail!("no volume to serve: give one or more VOLUME paths, or --config FILE with [[export]] tables");
        }
        crate::serve_config::name_exports(&mut specs, export_name.as_deref(), SINGLE_EXPORT_NAME)?;
        if specs.len() > 1 && meta_device.is_some() {
            usage_bail!("--meta-device applies to one volume; name each export's in a --config file");
        }
        if specs.len() > 1 && tier.tier_device.is_some() {
            usage_bail!("--tier-device applies to one volume");
        }
        if let (Some(only), Some(m)) = (specs.first_mut(), meta_device) {
            only.meta_device = Some(m);
        }
        for name in &read_only_export {
            match specs.iter_mut().find(|s| &s.name == name) {
                Some(s) => s.read_only = true,
                None => usage_bail!("--read-only-export {name}: no export of that name"),
            }
        }
        if read_only {
            specs.iter_mut().for_each(|s| s.read_only = true);
        }
        let connections_max = connections_max.or(file.connections_max).unwrap_or(CONNECTIONS_MAX_DEFAULT);
        if connections_max == 0 {
            usage_bail!("--connections-max must be at least 1");
        }
        if !(1..=64).contains(&workers_per_connection) {
            usage_bail!("--workers-per-connection must be between 1 and 64");
        }
        let addr = match (socket.or(file.socket.clone()), listen.or(file.listen.clone())) {
            (Some(p), None) => ListenAddr::Unix(p),
            (_, Some(l)) => ListenAddr::Tcp(l),
            (None, None) => ListenAddr::Tcp(LISTEN_DEFAULT.into()),
        };
        let tls_files = match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key, client_ca: tls_client_ca, allowed_names: tls_allow }),
            _ => file.tls.as_ref().map(|t| t.files()),
        };
        let tls_mode = match tls.as_deref() {
            Some("on") => Some(TlsMode::On),
            Some(_) => Some(TlsMode::Require),
            None => file.tls.as_ref().and_then(|t| t.mode),
        };
        let tls_policy = crate::serve_config::tls_policy(tls_files.as_ref(), tls_mode, &addr, insecure)?;
        let metrics = metrics.or(file.metrics.clone());

        // Open every volume (replaying journals if needed) before listening, so a client
        // never connects to a server that then fails to open.
        let cache_size = cache_size.or(file.cache_size.clone()).unwrap_or_else(|| "auto".into());
        let cache_total = if in_memory.is_some() {
            0
        } else if cache_size == "auto" {
            let b = crate::memory::auto_cache_bytes();
            tracing::info!("content cache {} MiB (--cache-size auto)", b >> 20);
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
        let per_volume_cache = cache_total / specs.len() as u64;
        let mut served: Vec<Served> = Vec::with_capacity(specs.len());
        let opened = (|| -> anyhow::Result<()> {
            for spec in &specs {
                let config = ExportConfig {
                    name: spec.name.clone(),
                    description: Some(format!("dedupvol volume {}", spec.path.display())),
                    read_only: spec.read_only,
                };
                let (volume, backend): (Option<Arc<Volume>>, Arc<dyn Backend>) = match &in_memory {
                    Some(size) => {
                        let size = dedupvol_core::parse_size(size)
                            .map_err(|e| crate::usage(format!("--in-memory {size}: {e}")))?;
                        (None, Arc::new(MemBackend::new(size, spec.read_only).map_err(|e| anyhow::anyhow!("{e}"))?))
                    }
                    None => {
                        let opts = OpenOptions {
                            read_only: spec.read_only,
                            write_policy,
                            io_mode: io,
                            content_cache_bytes: per_volume_cache,
                            cache_writes,
                            index_memory_bytes,
                            tier: tier.options(),
                            woj,
                            take_over,
                            defer_compression_micros: defer_compression_us,
                            ..Default::default()
                        };
                        // The engine's FileStorage holds an flock (exclusive read-write, shared
                        // read-only) for as long as the volume is open; open_path finds a
                        // separate metadata device from the superblock unless one is named,
                        // and replays the journal after a crash.
                        let v = Volume::open_path(&spec.path, spec.meta_device.as_deref(), &opts)
                            .with_context(|| format!("opening volume {}", spec.path.display()))?;
                        crate::volume_cmds::warn_tier_notes(&v);
                        let v = Arc::new(v);
                        (Some(v.clone()), v)
                    }
                };
                let cleaner = volume.as_ref().filter(|v| !v.is_read_only()).and_then(|v| {
                    dedupvol_core::Cleaner::spawn(
                        v,
                        CLEANER_INTERVAL,
                        CLEANER_TRIGGER_BYTES,
                        dedupvol_core::CleanOptions::default(),
                    )
                });
                served.push(Served { spec: spec.clone(), volume, export: Export::new(config, backend), cleaner });
            }
            Ok(())
        })();
        // Whatever happens next, every volume opened is closed cleanly: dropping one
        // unclosed would look like a crash and cost a journal replay at the next open.
        let outcome = opened.and_then(|()| {
            let config = ServerConfig {
                connections_max,
                limits: ConnectionLimits { workers: workers_per_connection, ..Default::default() },
                tls: tls_policy,
            };
            serve(&addr, config, &mut served, metrics)
        });
        let mut closed: anyhow::Result<()> = Ok(());
        let mut tier_stats = None;
        let mut woj_lines = Vec::new();
        for s in served {
            drop(s.export);
            drop(s.cleaner);
            if let Some(v) = s.volume {
                let r = match Arc::try_unwrap(v) {
                    Ok(v) => {
                        let st = v.stats();
                        tier_stats = tier_stats.or(st.tier);
                        for l in st.woj.as_ref().map(crate::volume_cmds::woj_summary).unwrap_or_default() {
                            woj_lines.push(format!("export {:?}: {l}", s.spec.name));
                        }
                        v.close().with_context(|| format!("closing volume {}", s.spec.path.display()))
                    }
                    Err(_) => Err(anyhow::anyhow!(
                        "volume {} still referenced after the server stopped; not closed",
                        s.spec.path.display()
                    )),
                };
                if closed.is_ok() {
                    closed = r;
                }
            }
        }
        let summary = outcome?;
        closed?;
        tracing::info!(
            "stopped after {} connection(s) ({} refused); volume(s) closed",
            summary.connections_served,
            summary.connections_refused
        );
        for l in woj_lines {
            tracing::info!("{l}");
        }
        if let Some(t) = tier_stats {
            tracing::info!("{}", crate::volume_cmds::tier_summary(&t));
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// Binds, starts the admin sockets and the metrics endpoint, prints the readiness line,
/// and serves until SIGINT/SIGTERM/SIGHUP. On return the side services have stopped and
/// been joined, and the server holds no export: the caller holds the only reference to
/// each volume (besides `served`'s own export handles, which it drops first).
fn serve(
    addr: &ListenAddr,
    config: ServerConfig,
    served: &mut [Served],
    metrics_addr: Option<String>,
) -> anyhow::Result<RunSummary> {
    let server = Server::bind(addr, config).with_context(|| format!("listening on {addr}"))?;
    server.stop_on_signals().context("installing signal handlers")?;
    let started = std::time::Instant::now();
    // A server of one export keeps counting refusals in the export's own figures.
    let single = served.len() == 1;
    if single {
        if let Some(s) = served.first_mut() {
            s.export.metrics = server.metrics();
        }
    }
    let sources: Vec<crate::admin::Source> = served
        .iter()
        .map(|s| crate::admin::Source {
            volume: s.volume.clone(),
            metrics: s.export.metrics.clone(),
            server_metrics: server.metrics(),
            export: s.export.config.name.clone(),
            address: server.display_addr(),
            started,
        })
        .collect();
    // Started before the readiness line, so a script that waited for it finds them.
    let metrics_service = match &metrics_addr {
        Some(a) => Some(crate::metrics::start(a, sources.clone()).with_context(|| format!("--metrics {a}"))?),
        None => None,
    };
    // Without its admin socket a volume is still served; `stats` then cannot reach it.
    let mut admins = Vec::new();
    for (s, source) in served.iter().zip(&sources) {
        if s.volume.is_none() {
            continue;
        }
        match crate::admin::start(&s.spec.path, source.clone()) {
            Ok(Some(a)) => admins.push(a),
            Ok(None) => {}
            Err(e) => tracing::warn!("no admin socket for {}: {}", s.spec.path.display(), crate::error_line(&e)),
        }
    }
    drop(sources);
    let list: Vec<String> =
        served.iter().map(|s| format!("{} ({} bytes)", s.export.config.name, s.export.backend.size())).collect();
    // A reader that closed our stdout after the readiness line does not stop the server.
    outln!("dedupvol: serving {} on {}", list.join(", "), server.display_addr())?;
    // After the readiness line, which stays the first line scripts wait for.
    if let Some(m) = &metrics_service {
        outln!("dedupvol: metrics on http://{}/metrics", m.address())?;
    }
    for s in served.iter() {
        tracing::info!(
            "export {:?}: {} ({} bytes{})",
            s.export.config.name,
            s.spec.path.display(),
            s.export.backend.size(),
            if s.export.config.read_only { ", read-only" } else { "" }
        );
    }
    // systemd (Type=notify) learns the server is ready; without NOTIFY_SOCKET this does nothing.
    let _ = sd_notify::notify(
        false,
        &[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&format!("serving {}", list.join(", ")))],
    );
    let exports: Vec<Export> = served.iter().map(|s| s.export.clone()).collect();
    let summary = server.run_exports(exports).context("serving");
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    // Stopped before the volumes are closed: they hold them.
    for a in admins {
        a.stop();
    }
    if let Some(m) = metrics_service {
        m.stop();
    }
    summary
}
