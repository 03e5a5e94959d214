//! The simulator against a striped volume (`StripedVolume`: the data disk cut into parts,
//! one per data device): crashes (also inside recovery), torn and lost unsynced writes,
//! destaging, transient read and write errors and superblock copy damage, recovery
//! verified block by block and every clean close audited. Persistent data faults are off:
//! the driver locates a damaged block as `data_start + pbn`, which a stripe does not follow.

use dedupvol_sim::{run_seed, FaultKinds, RunStats, SimOptions, StripedVolume};

const SEEDS: u64 = 60;

#[test]
fn striped_volume_seeds_pass() {
    let opts = SimOptions {
        faults: FaultKinds { lost: false, misdirect: false, bitflip: false, read_flip: false, ..FaultKinds::all() },
        ..SimOptions::default()
    };
    let mut total = RunStats::default();
    let mut failures = Vec::new();
    for seed in 1000..1000 + SEEDS {
        match run_seed::<StripedVolume>(seed, &opts) {
            Ok(s) => total.add(&s),
            Err(f) => {
                eprintln!("{f}");
                failures.push(format!("seed {}: {}\n    replay: {}", f.seed, f.message, f.replay));
            }
        }
    }
    eprintln!(
        "{SEEDS} striped seeds: {} crashes ({} in recovery), {} recoveries, {} clean audits, {} blocks verified; faults: {}",
        total.crashes,
        total.crashes_in_recovery,
        total.recoveries,
        total.clean_checks,
        total.blocks_verified,
        total.faults.summary()
    );
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.crashes >= SEEDS, "too few crashes: {}", total.crashes);
    assert!(total.clean_checks >= SEEDS, "too few audited clean closes: {}", total.clean_checks);
    assert!(total.coverage.dedup_hits > 0, "no duplicate shared");
    // The striped engine forwards recompression and rest level changes (it once did not,
    // and striped volumes were never recompressed here).
    assert!(total.fragments_recompressed > 0, "no recompression pass replaced a fragment of a striped volume");
    assert!(total.rest_level_changes > 0, "no striped volume was given a rest level");
}
