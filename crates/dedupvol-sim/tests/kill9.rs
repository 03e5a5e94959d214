//! Real-process crash test: the `dedupvol-sim --child-writer` process writes a deterministic
//! pattern to a volume on a real file and prints "flushed K" after each flush; we SIGKILL it
//! mid-workload, reopen the file (journal replay), require every block to hold the content of
//! its last write flushed by iteration K (or of a write from the one or two iterations in
//! flight), and require `check_volume` to find the closed volume clean. Three rounds on one
//! file, so recovery of a volume that was itself recovered is covered too. A negative
//! control runs a child that reports flushes it never made, and must be caught.

use dedupvol_core::{check_volume, FileStorage, Storage, Volume};
use dedupvol_sim::content::{self, BLOCK};
use dedupvol_sim::kill9::{child_open_options, writes_of_iteration, CHILD_LOGICAL_BLOCKS};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// Iterations after the last reported flush whose writes may also have landed.
const ITERATIONS_IN_FLIGHT_MAX: u64 = 2;

fn run_rounds(lie: bool) -> Result<Vec<String>, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("kill9.img");
    let mut durable: Vec<u64> = vec![content::ZERO; CHILD_LOGICAL_BLOCKS as usize];
    let mut start = 1u64;
    let mut notes = Vec::new();
    for (round, kill_after_lines) in [60u64, 400, 3].into_iter().enumerate() {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dedupvol-sim"));
        cmd.arg("--child-writer").arg(&path).arg("--child-start").arg(start.to_string());
        if lie {
            cmd.arg("--child-lie");
        }
        let mut child =
            cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| format!("spawn: {e}"))?;
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let mut last_flushed: Option<u64> = None;
        let mut seen = 0u64;
        let mut killed = false;
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| e.to_string())?;
            if let Some(k) = line.strip_prefix("flushed ") {
                last_flushed = Some(k.parse().map_err(|_| format!("bad line {line:?}"))?);
                seen += 1;
                if seen == kill_after_lines {
                    child.kill().map_err(|e| format!("SIGKILL: {e}"))?;
                    killed = true;
                    // Keep reading: lines already in the pipe were printed after their flush.
                }
            }
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        assert!(killed, "round {round}: child exited on its own ({status}) after {seen} flushes");
        assert!(status.code().is_none(), "round {round}: child was not killed by the signal: {status}");
        let k_last = last_flushed.ok_or("no flush was reported")?;
        assert!(k_last + 1 >= start + kill_after_lines, "round {round}: reported flushes went backwards");

        // What the contract allows for each block.
        let mut allowed: Vec<Vec<u64>> = durable.iter().map(|&id| vec![id]).collect();
        for k in start..=k_last {
            for (lba, id) in writes_of_iteration(k) {
                allowed[lba as usize] = vec![id];
            }
        }
        for k in k_last + 1..=k_last + ITERATIONS_IN_FLIGHT_MAX {
            for (lba, id) in writes_of_iteration(k) {
                allowed[lba as usize].push(id);
            }
        }

        let data: Arc<dyn Storage> = Arc::new(FileStorage::open(&path, false).map_err(|e| e.to_string())?);
        let vol = Volume::open(data.clone(), None, &child_open_options())
            .map_err(|e| format!("round {round}: volume did not recover after SIGKILL at flush {k_last}: {e}"))?;
        let mut buf = vec![0u8; BLOCK];
        for lba in 0..CHILD_LOGICAL_BLOCKS {
            vol.read(lba * BLOCK as u64, &mut buf)
                .map_err(|e| format!("round {round}: read of lba {lba} failed after recovery: {e}"))?;
            match content::identify(&buf, &allowed[lba as usize]) {
                Some(id) => durable[lba as usize] = id,
                None => {
                    return Err(format!(
                        "round {round}: lba {lba} reads {} after SIGKILL at flush {k_last}; allowed {:x?}",
                        content::describe(&buf),
                        allowed[lba as usize]
                    ))
                }
            }
        }
        vol.close().map_err(|e| format!("round {round}: close failed: {e}"))?;
        let report = check_volume(data, None, false).map_err(|e| format!("round {round}: check failed to run: {e}"))?;
        if !report.is_clean() {
            return Err(format!("round {round}: check found problems after SIGKILL recovery: {:?}", report.problems));
        }
        notes.push(format!(
            "round {round}: killed after flush {k_last}; {CHILD_LOGICAL_BLOCKS} blocks verified; check clean"
        ));
        start = k_last + ITERATIONS_IN_FLIGHT_MAX + 1;
    }
    Ok(notes)
}

#[test]
fn sigkill_during_writes_keeps_flushed_data_and_a_clean_volume() {
    match run_rounds(false) {
        Ok(notes) => notes.iter().for_each(|n| eprintln!("{n}")),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_child_that_reports_unflushed_writes_is_caught() {
    let r = run_rounds(true);
    assert!(r.is_err(), "the kill -9 test accepted a child that never flushed: {r:?}");
    eprintln!("negative control caught: {}", r.err().unwrap_or_default());
}
