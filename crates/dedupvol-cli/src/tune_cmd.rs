//! `dedupvol tune`: settings of an existing volume that can change after format: the rest
//! level (compression at rest) and the extent cap. A served volume is changed by its
//! server (admin socket request `tune rest-level=N extent-max=BLOCKS`), a closed one here.

use crate::volume_cmds::OpenArgs;
use anyhow::Context;
use clap::Args;
use dedupvol_core::{OpenOptions, Volume};
use serde::{Deserialize, Serialize};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
#[command(group(clap::ArgGroup::new("setting").required(true).multiple(true).args(["rest_level", "extent_max"])))]
pub struct TuneArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// zstd level (1..=19) data at rest is recompressed to once the volume is idle (zstd
    /// volumes). A volume without one gets format version 4 (5 when striped), which older
    /// builds refuse; a level cannot be removed again. Settled data keeps its level.
    #[arg(long)]
    rest_level: Option<String>,
    /// Largest extent formed from now on (4K..64K, a multiple of 4K; see `format
    /// --extent-max`). Extents already stored keep their size until they are rewritten
    /// (settling at rest regroups the fragments it takes to the new size). No format
    /// version change: older builds open the volume and ignore the setting.
    #[arg(long, value_parser = crate::volume_cmds::extent_size)]
    extent_max: Option<u8>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// What `tune` changed (a setting not asked for is absent).
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct TuneReport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rest_level_before: Option<i8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rest_level_after: Option<i8>,
    /// Extent caps in 4 KiB blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    extent_blocks_max_before: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    extent_blocks_max_after: Option<u8>,
    online: bool,
}

/// Applies the settings asked for to an open volume, the rest level first; stops at the
/// first refusal (what was applied before it stays, and the report says so).
fn apply(
    vol: &Volume,
    rest: Option<i8>,
    extent: Option<u8>,
    online: bool,
) -> (TuneReport, Option<dedupvol_core::Error>) {
    let mut r = TuneReport { online, ..TuneReport::default() };
    if let Some(level) = rest {
        match vol.set_rest_level(level) {
            Ok(before) => (r.rest_level_before, r.rest_level_after) = (Some(before), Some(level)),
            Err(e) => return (r, Some(e)),
        }
    }
    if let Some(blocks) = extent {
        match vol.set_extent_blocks_max(blocks) {
            Ok(before) => (r.extent_blocks_max_before, r.extent_blocks_max_after) = (Some(before), Some(blocks)),
            Err(e) => return (r, Some(e)),
        }
    }
    (r, None)
}

/// The admin socket's answer to `tune rest-level=N extent-max=BLOCKS` (either or both).
pub(crate) fn answer(vol: &Arc<Volume>, request: &str) -> serde_json::Value {
    let (mut rest, mut extent) = (None, None);
    for word in request.split_whitespace().skip(1) {
        match word.split_once('=') {
            Some(("rest-level", v)) => match v.parse::<i8>() {
                Ok(n) => rest = Some(n),
                Err(_) => return serde_json::json!({ "error": format!("tune argument {word:?} is not a level") }),
            },
            Some(("extent-max", v)) => match v.parse::<u8>() {
                Ok(n) => extent = Some(n),
                Err(_) => return serde_json::json!({ "error": format!("tune argument {word:?} is not a block count") }),
            },
            _ => return serde_json::json!({ "error": format!("unknown tune argument {word:?}") }),
        }
    }
    if rest.is_none() && extent.is_none() {
        return serde_json::json!({ "error": "tune needs rest-level=N or extent-max=BLOCKS" });
    }
    match apply(vol, rest, extent, true) {
        (_, Some(e)) => serde_json::json!({ "error": e.to_string() }),
        (r, None) => serde_json::to_value(r).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() })),
    }
}

pub fn run(a: TuneArgs) -> anyhow::Result<ExitCode> {
    let rest = a.rest_level.as_deref().map(crate::volume_cmds::parse_rest_level).transpose()?;
    let path = &a.vol.path;
    let mut request = String::from("tune");
    if let Some(level) = rest {
        request.push_str(&format!(" rest-level={level}"));
    }
    if let Some(blocks) = a.extent_max {
        request.push_str(&format!(" extent-max={blocks}"));
    }
    let report = match crate::admin::request(path, &request)? {
        Some((answer, sock)) => serde_json::from_str::<TuneReport>(&answer)
            .with_context(|| format!("decoding the answer of {}", sock.display()))?,
        None => {
            let opts =
                OpenOptions { io_mode: a.vol.io, index_memory_bytes: a.vol.index_memory, ..OpenOptions::default() };
            let vol = Volume::open_path(path, a.vol.meta_device.as_deref(), &opts)
                .with_context(|| format!("opening {}", path.display()))?;
            let (report, err) = apply(&vol, rest, a.extent_max, false);
            // Closed either way: the lock is released, and a refused change left the
            // volume as it was.
            let closed = vol.close().with_context(|| format!("closing {}", path.display()));
            if let Some(e) = err {
                return Err(anyhow::Error::new(e).context(format!("tuning {}", path.display())));
            }
            closed?;
            report
        }
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let (Some(before), Some(after)) = (report.rest_level_before, report.rest_level_after) {
        let name = |l: i8| if l == 0 { "none".to_string() } else { format!("zstd level {l}") };
        outln!(
            "{}: rest level {} -> {}{}",
            path.display(),
            name(before),
            name(after),
            if report.online {
                " (the server settles data at rest when its clients are idle)"
            } else {
                " (data is settled at rest when the volume is served and idle, or by `import --settle`)"
            }
        )?;
    }
    if let (Some(before), Some(after)) = (report.extent_blocks_max_before, report.extent_blocks_max_after) {
        outln!(
            "{}: largest extent {} KiB -> {} KiB (for data written or settled from now on)",
            path.display(),
            u32::from(before) * 4,
            u32::from(after) * 4
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
