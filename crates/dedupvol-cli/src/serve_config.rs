//! What `dedupvol serve` is asked to serve: exports from the command line (`PATH`,
//! `NAME=PATH`) and from a TOML file (`--config`), their names, and the TLS policy.
//!
//! The file (every key optional; unknown keys are refused, so a typo is not silently
//! ignored):
//!
//! ```toml
//! listen = "0.0.0.0:10809"        # or socket = "/run/dedupvol/nbd.sock"
//! connections_max = 32
//! cache_size = "4G"               # or "auto"; shared evenly by the exports
//! metrics = "127.0.0.1:9187"
//!
//! [tls]
//! cert = "/etc/dedupvol/server-cert.pem"
//! key = "/etc/dedupvol/server-key.pem"
//! client_ca = "/etc/dedupvol/ca-cert.pem"   # clients must present a certificate it signed
//! allow = ["backup-host", "vm-host-1"]      # and be named here (CN or DNS name)
//! mode = "require"                          # or "on" (loopback only)
//!
//! [[export]]
//! name = "db"
//! path = "/srv/volumes/db.img"
//! meta_device = "/dev/nvme0n1p3"
//! read_only = false
//! ```
//!
//! Invariants:
//! - Export names are unique, non-empty and within the protocol's bound; paths are non-empty.
//! - Plain NBD beyond loopback is refused unless asked for (`--insecure`); a TLS server on
//!   a non-loopback address requires TLS (mode `on` is refused there).

use anyhow::Context;
use dedupvol_nbd::{ListenAddr, TlsFiles, TlsPolicy};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Largest config file read.
const CONFIG_BYTES_MAX: u64 = 1 << 20;

/// One export to serve.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ExportSpec {
    /// Export name (empty: chosen by [`name_exports`]).
    #[serde(default)]
    pub name: String,
    /// The volume's data device or file.
    pub path: PathBuf,
    /// Its separate metadata device, if it has one and the superblock's path is not right.
    #[serde(default)]
    pub meta_device: Option<PathBuf>,
    /// Serve it read-only.
    #[serde(default)]
    pub read_only: bool,
}

impl ExportSpec {
    /// `PATH` or `NAME=PATH` from the command line. A path containing `=` is taken whole
    /// when it exists as given.
    pub fn parse(arg: &str) -> anyhow::Result<ExportSpec> {
        if arg.is_empty() {
            usage_bail!("an empty VOLUME argument");
        }
        let whole = ExportSpec { name: String::new(), path: arg.into(), meta_device: None, read_only: false };
        if Path::new(arg).exists() {
            return Ok(whole);
        }
        match arg.split_once('=') {
            Some((name, path)) if !name.is_empty() && !name.contains('/') => {
                if path.is_empty() {
                    usage_bail!("{arg}: no path after {name}=");
                }
                Ok(ExportSpec { name: name.into(), path: path.into(), meta_device: None, read_only: false })
            }
            _ => Ok(whole),
        }
    }
}

/// Whether TLS is required of clients or only offered.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// Clients must upgrade before anything else.
    Require,
    /// Offered; plain clients are served too.
    On,
}

/// The `[tls]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    cert: PathBuf,
    key: PathBuf,
    #[serde(default)]
    client_ca: Option<PathBuf>,
    #[serde(default)]
    allow: Vec<String>,
    /// Require or only offer (default: require).
    #[serde(default)]
    pub mode: Option<TlsMode>,
}

impl TlsSection {
    /// The files it names.
    pub fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.cert.clone(),
            key: self.key.clone(),
            client_ca: self.client_ca.clone(),
            allowed_names: self.allow.clone(),
        }
    }
}

/// A `--config` file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFile {
    /// TCP address.
    #[serde(default)]
    pub listen: Option<String>,
    /// Unix-domain socket.
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// Connection limit.
    #[serde(default)]
    pub connections_max: Option<usize>,
    /// Content cache for all exports.
    #[serde(default)]
    pub cache_size: Option<String>,
    /// Metrics endpoint.
    #[serde(default)]
    pub metrics: Option<String>,
    /// TLS.
    #[serde(default)]
    pub tls: Option<TlsSection>,
    /// Exports.
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportSpec>,
}

impl ServeFile {
    /// Reads and checks a config file; every mistake names the file.
    pub fn load(path: &Path) -> anyhow::Result<ServeFile> {
        use std::io::Read;
        let f = std::fs::File::open(path).with_context(|| format!("opening --config {}", path.display()))?;
        let mut text = String::new();
        f.take(CONFIG_BYTES_MAX + 1)
            .read_to_string(&mut text)
            .with_context(|| format!("reading --config {}", path.display()))?;
        if text.len() as u64 > CONFIG_BYTES_MAX {
            usage_bail!("--config {}: larger than {} bytes", path.display(), CONFIG_BYTES_MAX);
        }
        let file: ServeFile =
            toml::from_str(&text).map_err(|e| crate::usage(format!("--config {}: {e}", path.display())))?;
        if file.listen.is_some() && file.socket.is_some() {
            usage_bail!("--config {}: give listen or socket, not both", path.display());
        }
        for e in &file.exports {
            if e.path.as_os_str().is_empty() {
                usage_bail!("--config {}: an [[export]] has an empty path", path.display());
            }
        }
        Ok(file)
    }
}

/// Gives every unnamed export a name — `single` (or `--export-name`) when there is one
/// export, its file name without extension otherwise — and checks names are unique.
pub fn name_exports(specs: &mut [ExportSpec], export_name: Option<&str>, single: &str) -> anyhow::Result<()> {
    if let Some(n) = export_name {
        match specs {
            [only] if only.name.is_empty() => only.name = n.to_string(),
            [_] => usage_bail!("--export-name {n}: the volume is already named"),
            _ => usage_bail!("--export-name names a single volume; name several as NAME=PATH"),
        }
    }
    let one = specs.len() == 1;
    for s in specs.iter_mut().filter(|s| s.name.is_empty()) {
        s.name = if one {
            single.to_string()
        } else {
            s.path.file_stem().map(|x| x.to_string_lossy().into_owned()).unwrap_or_default()
        };
        if s.name.is_empty() {
            usage_bail!("{}: cannot name an export after this path; use NAME=PATH", s.path.display());
        }
    }
    let mut seen = std::collections::HashSet::new();
    for s in specs.iter() {
        if s.name.len() > dedupvol_nbd::proto::NAME_BYTES_MAX {
            usage_bail!("export name {:?} is longer than {} bytes", s.name, dedupvol_nbd::proto::NAME_BYTES_MAX);
        }
        if !seen.insert(s.name.as_str()) {
            usage_bail!("two exports are named {:?}; name them apart with NAME=PATH", s.name);
        }
    }
    if specs.len() > dedupvol_nbd::EXPORTS_MAX {
        usage_bail!("{} volumes; one server serves at most {}", specs.len(), dedupvol_nbd::EXPORTS_MAX);
    }
    Ok(())
}

/// True when every address `addr` resolves to is a loopback address (a Unix socket is
/// local too).
pub fn is_local(addr: &ListenAddr) -> anyhow::Result<bool> {
    use std::net::ToSocketAddrs;
    match addr {
        ListenAddr::Unix(_) => Ok(true),
        ListenAddr::Tcp(a) => {
            let resolved: Vec<_> =
                a.to_socket_addrs().with_context(|| format!("listening on {a}: resolving the address"))?.collect();
            Ok(!resolved.is_empty() && resolved.iter().all(|s| s.ip().is_loopback()))
        }
    }
}

/// The server's TLS policy from its files and mode; refuses plain NBD (or optional TLS)
/// beyond loopback unless `insecure`.
pub fn tls_policy(
    files: Option<&TlsFiles>,
    mode: Option<TlsMode>,
    addr: &ListenAddr,
    insecure: bool,
) -> anyhow::Result<Option<TlsPolicy>> {
    let local = is_local(addr)?;
    let Some(files) = files else {
        if mode.is_some() {
            usage_bail!("--tls needs --tls-cert and --tls-key");
        }
        if !local && !insecure {
            usage_bail!(
                "listening on {addr}, beyond loopback, needs TLS (--tls-cert, --tls-key); \
                 --insecure serves plain NBD there (trusted networks only)"
            );
        }
        return Ok(None);
    };
    let mode = mode.unwrap_or(TlsMode::Require);
    if mode == TlsMode::On && !local && !insecure {
        usage_bail!("--tls on lets plain clients in; beyond loopback TLS must be required (or add --insecure)");
    }
    let policy = TlsPolicy::load(files, mode == TlsMode::Require).map_err(|e| crate::usage(format!("TLS: {e}")))?;
    Ok(Some(policy))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, path: &str) -> ExportSpec {
        ExportSpec { name: name.into(), path: path.into(), meta_device: None, read_only: false }
    }

    #[test]
    fn names_come_from_stems_or_are_given() {
        let mut v = vec![ExportSpec::parse("/x/a.img").expect("a"), ExportSpec::parse("db=/x/b.img").expect("b")];
        name_exports(&mut v, None, "dedupvol").expect("named");
        assert_eq!(v, vec![spec("a", "/x/a.img"), spec("db", "/x/b.img")]);
        let mut one = vec![ExportSpec::parse("/x/a.img").expect("a")];
        name_exports(&mut one, None, "dedupvol").expect("named");
        assert_eq!(one[0].name, "dedupvol");
        let mut one = vec![ExportSpec::parse("/x/a.img").expect("a")];
        name_exports(&mut one, Some("vm"), "dedupvol").expect("named");
        assert_eq!(one[0].name, "vm");
    }

    #[test]
    fn duplicate_names_and_misplaced_export_names_are_usage_errors() {
        let mut v = vec![spec("", "/x/a.img"), spec("", "/y/a.img")];
        let e = name_exports(&mut v, None, "dedupvol").expect_err("duplicate");
        assert!(e.to_string().contains("two exports are named \"a\""), "{e}");
        let mut v = vec![spec("", "/x/a.img"), spec("", "/y/b.img")];
        let e = name_exports(&mut v, Some("n"), "dedupvol").expect_err("several");
        assert!(e.to_string().contains("single volume"), "{e}");
    }

    #[test]
    fn a_config_file_is_parsed_and_typos_are_refused() {
        let f: ServeFile = toml::from_str(
            "listen = \"127.0.0.1:0\"\n[tls]\ncert = \"c\"\nkey = \"k\"\nmode = \"on\"\n\
             [[export]]\nname = \"a\"\npath = \"/a\"\nread_only = true\n[[export]]\npath = \"/b.img\"\n",
        )
        .expect("parsed");
        assert_eq!(f.exports.len(), 2);
        assert!(f.exports[0].read_only);
        assert_eq!(f.tls.as_ref().and_then(|t| t.mode), Some(TlsMode::On));
        assert!(toml::from_str::<ServeFile>("lsten = \"x\"\n").is_err(), "unknown key");
        assert!(toml::from_str::<ServeFile>("[[export]]\nname = \"a\"\n").is_err(), "no path");
    }

    #[test]
    fn plain_nbd_beyond_loopback_needs_insecure() {
        let any = ListenAddr::Tcp("0.0.0.0:0".into());
        let lo = ListenAddr::Tcp("127.0.0.1:0".into());
        assert!(tls_policy(None, None, &lo, false).expect("loopback").is_none());
        let e = tls_policy(None, None, &any, false).expect_err("refused");
        assert!(e.to_string().contains("needs TLS"), "{e}");
        assert!(tls_policy(None, None, &any, true).expect("insecure").is_none());
        assert!(is_local(&ListenAddr::Unix("/tmp/x.sock".into())).expect("unix"));
    }
}
