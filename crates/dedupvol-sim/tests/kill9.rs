//! Real-process crash test: the `dedupvol-sim --child-writer` process writes a deterministic
//! pattern to a volume on a real file and prints "flushed K" after each flush; we SIGKILL it
//! mid-workload, reopen the file (journal replay), require every block to hold the content of
//! its last write flushed by iteration K (or of a write from the one or two iterations in
//! flight), and require `check_volume` to find the closed volume clean. Three rounds on one
//! file, so recovery of a volume that was itself recovered is covered too.

use dedupvol_core::{check_volume, FileStorage, Storage, Volume};
use dedupvol_sim::content::{self, BLOCK};
use dedupvol_sim::kill9::{child_open_options, writes_of_iteration, CHILD_LOGICAL_BLOCKS};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// Iterations after the last reported flush whose writes may also have landed.
const ITERATIONS_IN_FLIGHT_MAX: u64 = 2;

#[test]
fn sigkill_during_writes_keeps_flushed_data_and_a_clean_volume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kill9.img");
    let mut durable: Vec<u64> = vec![content::ZERO; CHILD_LOGICAL_BLOCKS as usize];
    let mut start = 1u64;
    for (round, kill_after_lines) in [60u64, 400, 3].into_iter().enumerate() {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dedupvol-sim"))
            .arg("--child-writer")
            .arg(&path)
            .arg("--child-start")
            .arg(start.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child writer");
        let stdout = child.stdout.take().expect("child stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut last_flushed: Option<u64> = None;
        let mut seen = 0u64;
        let mut killed = false;
        for line in lines.by_ref() {
            let line = line.expect("child output");
            if let Some(k) = line.strip_prefix("flushed ") {
                last_flushed = Some(k.parse().expect("iteration number"));
                seen += 1;
                if seen == kill_after_lines {
                    child.kill().expect("SIGKILL the child");
                    killed = true;
                    // Keep reading: lines already in the pipe were printed after their flush.
                }
            }
        }
        let status = child.wait().expect("wait for child");
        assert!(killed, "round {round}: child exited on its own ({status}) after {seen} flushes");
        assert!(status.code().is_none(), "round {round}: child was not killed by the signal: {status}");
        let k_last = last_flushed.expect("at least one flush was reported");
        assert!(k_last >= start + kill_after_lines - 1, "round {round}: reported flushes went backwards");

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

        let data: Arc<dyn Storage> = Arc::new(FileStorage::open(&path, false).expect("open file"));
        let vol = Volume::open(data.clone(), None, &child_open_options())
            .unwrap_or_else(|e| panic!("round {round}: volume did not recover after SIGKILL at flush {k_last}: {e}"));
        let mut buf = vec![0u8; BLOCK];
        for lba in 0..CHILD_LOGICAL_BLOCKS {
            vol.read(lba * BLOCK as u64, &mut buf)
                .unwrap_or_else(|e| panic!("round {round}: read of lba {lba} failed after recovery: {e}"));
            match content::identify(&buf, &allowed[lba as usize]) {
                Some(id) => durable[lba as usize] = id,
                None => panic!(
                    "round {round}: lba {lba} reads {} after SIGKILL at flush {k_last}; allowed {:x?}",
                    content::describe(&buf),
                    allowed[lba as usize]
                ),
            }
        }
        vol.close().unwrap_or_else(|e| panic!("round {round}: close failed: {e}"));
        let report = check_volume(data, None, false).unwrap_or_else(|e| panic!("round {round}: check failed to run: {e}"));
        assert!(report.is_clean(), "round {round}: check found problems after SIGKILL recovery: {:?}", report.problems);
        eprintln!("round {round}: killed after flush {k_last}; {CHILD_LOGICAL_BLOCKS} blocks verified; check clean");
        start = k_last + ITERATIONS_IN_FLIGHT_MAX + 1;
    }
}
