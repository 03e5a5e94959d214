//! `dedupvol grow`: a volume's logical size, or the data device under it. A served volume
//! is grown by its server (admin socket request `grow`); a closed one here, after the
//! data file is extended to the new physical size.

use crate::volume_cmds::{human, size, OpenArgs};
use anyhow::Context;
use clap::Args;
use dedupvol_core::{GrowReport, OpenOptions, Volume};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
pub struct GrowArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// New client-visible size (K/M/G/T). On a served volume it can only grow, within the
    /// room its block map was formatted with; a closed volume can grow further (metadata
    /// regions move, taking room from the fingerprint index) or shrink when no mapped
    /// block lies beyond the new end.
    #[arg(long, value_parser = size, required_unless_present = "physical_size")]
    logical_size: Option<u64>,
    /// New size of the data device (K/M/G/T): a file is extended to it, a block device
    /// must already be this large; it never shrinks. On a served volume, within the room
    /// its reference counts were formatted with; the new slabs are allocatable at once.
    #[arg(long, value_parser = size)]
    physical_size: Option<u64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// The admin socket's answer to `grow [logical=N] [physical=N]`.
pub(crate) fn answer(vol: &Arc<Volume>, request: &str) -> serde_json::Value {
    let mut logical = None;
    let mut physical = None;
    for word in request.split_whitespace().skip(1) {
        let parsed = match word.split_once('=') {
            Some(("logical", v)) => v.parse().map(|n| logical = Some(n)),
            Some(("physical", v)) => v.parse().map(|n| physical = Some(n)),
            _ => return serde_json::json!({ "error": format!("unknown grow argument {word:?}") }),
        };
        if parsed.is_err() {
            return serde_json::json!({ "error": format!("grow argument {word:?} is not a number of bytes") });
        }
    }
    match vol.grow(logical, physical) {
        Ok(r) => serde_json::to_value(r).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() })),
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

pub fn run(a: GrowArgs) -> anyhow::Result<ExitCode> {
    let path = &a.vol.path;
    let mut line = String::from("grow");
    if let Some(l) = a.logical_size {
        line.push_str(&format!(" logical={l}"));
    }
    if let Some(p) = a.physical_size {
        line.push_str(&format!(" physical={p}"));
    }
    let restore = extend_file(path, a.physical_size)?;
    let grown = match crate::admin::request(path, &line) {
        Ok(Some((answer, sock))) => serde_json::from_str::<GrowReport>(&answer)
            .with_context(|| format!("decoding the answer of {}", sock.display())),
        Ok(None) => grow_closed(&a),
        Err(e) => Err(e),
    };
    let report = match grown {
        Ok(r) => r,
        Err(e) => {
            // Leave the file as it was: the volume did not take the new size.
            if let Some((f, len)) = restore {
                let _ = f.set_len(len);
            }
            return Err(e);
        }
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print(path, &report)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Extends a regular data file to `physical_size` when it is smaller; returns the file
/// and its old length, to restore if the grow fails (a block device must be large enough
/// already).
fn extend_file(path: &Path, physical_size: Option<u64>) -> anyhow::Result<Option<(std::fs::File, u64)>> {
    let Some(want) = physical_size else { return Ok(None) };
    if dedupvol_core::RadosUrl::parse(path).is_some() {
        anyhow::bail!("a RADOS device keeps the size it was created with: only the logical size can grow");
    }
    let md = std::fs::metadata(path).with_context(|| format!("finding {}", path.display()))?;
    if !md.is_file() || md.len() >= want {
        return Ok(None);
    }
    let f =
        std::fs::OpenOptions::new().write(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    f.set_len(want).with_context(|| format!("extending {} to {want} bytes", path.display()))?;
    Ok(Some((f, md.len())))
}

/// Resizes the closed volume.
fn grow_closed(a: &GrowArgs) -> anyhow::Result<GrowReport> {
    let path = &a.vol.path;
    let opts = OpenOptions { io_mode: a.vol.io, index_memory_bytes: a.vol.index_memory, ..OpenOptions::default() };
    dedupvol_core::resize_path(path, a.vol.meta_device.as_deref(), a.logical_size, a.physical_size, &opts)
        .with_context(|| format!("growing {}", path.display()))
}

fn print(path: &Path, r: &GrowReport) -> std::io::Result<()> {
    outln!(
        "{} {}: logical {} -> {}, physical {} -> {} ({} data blocks){}",
        if r.logical_size_after < r.logical_size_before { "shrank" } else { "grew" },
        path.display(),
        human(r.logical_size_before),
        human(r.logical_size_after),
        human(r.physical_size_before),
        human(r.physical_size_after),
        r.data_blocks_after,
        if r.online { " while served: new NBD connections see the new size" } else { "" }
    )?;
    for m in &r.moved {
        outln!("  moved the {m} (pages copied before the switch)")?;
    }
    if r.index_blocks_after != r.index_blocks_before {
        outln!(
            "  fingerprint index ring {} -> {} (it starts empty: duplicates of older data are found again as they are rewritten)",
            human(r.index_blocks_before * 4096),
            human(r.index_blocks_after * 4096)
        )?;
    }
    if r.zero_blocks_unmapped > 0 {
        outln!("  unmapped {} blocks of zeros beyond the new end", r.zero_blocks_unmapped)?;
    }
    outln!(
        "  room to grow without moving metadata (also while served): logical up to {}, physical up to {}",
        human(r.logical_room_bytes),
        human(r.physical_room_bytes)
    )
}
