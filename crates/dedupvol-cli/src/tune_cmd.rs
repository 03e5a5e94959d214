//! `dedupvol tune`: settings of an existing volume that can change after format. Today the
//! rest level (compression at rest): a served volume is changed by its server (admin
//! socket request `tune rest-level=N`), a closed one here.

use crate::volume_cmds::OpenArgs;
use anyhow::Context;
use clap::Args;
use dedupvol_core::{OpenOptions, Volume};
use serde::{Deserialize, Serialize};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
pub struct TuneArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// zstd level (1..=19) data at rest is recompressed to once the volume is idle (zstd
    /// volumes). A volume without one gets format version 4 (5 when striped), which older
    /// builds refuse; a level cannot be removed again. Settled data keeps its level.
    #[arg(long, required = true)]
    rest_level: String,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// What `tune` changed.
#[derive(Serialize, Deserialize)]
pub(crate) struct TuneReport {
    rest_level_before: i8,
    rest_level_after: i8,
    online: bool,
}

/// The admin socket's answer to `tune rest-level=N`.
pub(crate) fn answer(vol: &Arc<Volume>, request: &str) -> serde_json::Value {
    let mut level = None;
    for word in request.split_whitespace().skip(1) {
        match word.split_once('=') {
            Some(("rest-level", v)) => match v.parse::<i8>() {
                Ok(n) => level = Some(n),
                Err(_) => return serde_json::json!({ "error": format!("tune argument {word:?} is not a level") }),
            },
            _ => return serde_json::json!({ "error": format!("unknown tune argument {word:?}") }),
        }
    }
    let Some(level) = level else { return serde_json::json!({ "error": "tune needs rest-level=N" }) };
    match vol.set_rest_level(level) {
        Ok(before) => {
            serde_json::to_value(TuneReport { rest_level_before: before, rest_level_after: level, online: true })
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
        }
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

pub fn run(a: TuneArgs) -> anyhow::Result<ExitCode> {
    let level = crate::volume_cmds::parse_rest_level(&a.rest_level)?;
    let path = &a.vol.path;
    let report = match crate::admin::request(path, &format!("tune rest-level={level}"))? {
        Some((answer, sock)) => serde_json::from_str::<TuneReport>(&answer)
            .with_context(|| format!("decoding the answer of {}", sock.display()))?,
        None => {
            let opts =
                OpenOptions { io_mode: a.vol.io, index_memory_bytes: a.vol.index_memory, ..OpenOptions::default() };
            let vol = Volume::open_path(path, a.vol.meta_device.as_deref(), &opts)
                .with_context(|| format!("opening {}", path.display()))?;
            let before = vol.set_rest_level(level).with_context(|| format!("tuning {}", path.display()));
            // Closed either way: the lock is released, and a failed change left the volume
            // as it was.
            let closed = vol.close().with_context(|| format!("closing {}", path.display()));
            let before = before?;
            closed?;
            TuneReport { rest_level_before: before, rest_level_after: level, online: false }
        }
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        let name = |l: i8| if l == 0 { "none".to_string() } else { format!("zstd level {l}") };
        outln!(
            "{}: rest level {} -> {}{}",
            path.display(),
            name(report.rest_level_before),
            name(report.rest_level_after),
            if report.online {
                " (the server settles data at rest when its clients are idle)"
            } else {
                " (data is settled at rest when the volume is served and idle, or by `import --settle`)"
            }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
