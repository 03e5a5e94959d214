//! CI run of the crash and fault simulator against the real engine: at least 200 seeds, each
//! a few hundred operations with crashes (also inside recovery), every fault kind switched on
//! per seed, recovery verified block by block and every clean close audited. A failure names
//! the seed and the one-line replay command.

use dedupvol_sim::{run_seed, RunStats, SimOptions};

/// Runs `seeds` against the real engine: the summed figures, and one line per failed seed.
fn run_seeds(seeds: std::ops::Range<u64>, opts: &SimOptions) -> (RunStats, Vec<String>) {
    let mut total = RunStats::default();
    let mut failures = Vec::new();
    for seed in seeds {
        match run_seed::<dedupvol_core::Volume>(seed, opts) {
            Ok(s) => total.add(&s),
            Err(f) => {
                eprintln!("{f}");
                failures.push(format!("seed {}: {}\n    replay: {}", f.seed, f.message, f.replay));
            }
        }
    }
    (total, failures)
}

/// Seeds run in CI.
const CI_SEEDS: u64 = 240;
/// First CI seed (kept apart from the soak's usual range so both find different bugs).
const CI_SEED_START: u64 = 0;

#[test]
fn simulator_seeds_pass() {
    let opts = SimOptions::default();
    let (total, failures) = run_seeds(CI_SEED_START..CI_SEED_START + CI_SEEDS, &opts);
    eprintln!(
        "{CI_SEEDS} seeds: {} crashes ({} in recovery), {} recoveries, {} clean audits, {} blocks verified; faults: {}",
        total.crashes,
        total.crashes_in_recovery,
        total.recoveries,
        total.clean_checks,
        total.blocks_verified,
        total.faults.summary()
    );
    assert!(failures.is_empty(), "{} of {CI_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    // The run must have exercised what it claims to (a simulator that never crashes
    // anything would pass trivially).
    assert!(total.crashes >= CI_SEEDS, "too few crashes: {}", total.crashes);
    assert!(total.crashes_in_recovery > 0, "no crash landed inside recovery");
    assert!(total.clean_checks >= CI_SEEDS, "too few audited clean closes: {}", total.clean_checks);
    assert!(total.faults.torn > 0 && total.faults.unsynced_lost > 0, "no torn or lost unsynced writes");
    assert!(
        total.faults.lost_writes + total.faults.misdirected_writes + total.faults.bit_flips > 0,
        "no persistent data faults"
    );
    assert!(total.faults.read_errors > 0, "no transient read errors");
}

/// Seeds run in CI with the engine's background data writer on (production's setting).
const CI_BACKGROUND_SEEDS: u64 = 80;

#[test]
fn simulator_seeds_pass_with_background_writes() {
    let opts = SimOptions { background_writes: true, ..SimOptions::default() };
    // A background-writes run may not reproduce call for call from its replay line.
    let (total, failures) = run_seeds(10_000..10_000 + CI_BACKGROUND_SEEDS, &opts);
    eprintln!("{CI_BACKGROUND_SEEDS} seeds with background writes: {} crashes", total.crashes);
    assert!(failures.is_empty(), "{} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.crashes >= CI_BACKGROUND_SEEDS, "too few crashes: {}", total.crashes);
}

#[test]
fn same_seed_same_io_sequence() {
    let opts = SimOptions::default();
    for seed in [5, 77] {
        let a = run_seed::<dedupvol_core::Volume>(seed, &opts).map_err(|f| f.to_string()).expect("first run");
        let b = run_seed::<dedupvol_core::Volume>(seed, &opts).map_err(|f| f.to_string()).expect("second run");
        assert_eq!(a.trace, b.trace, "seed {seed}: two runs made different I/O calls; the run is not reproducible");
        assert_eq!(a.faults, b.faults, "seed {seed}: two runs injected different faults");
    }
}

/// Seeds run with hot compressible blocks: single requests of 320 copies of one block, so a
/// fragment of a still-open packed block passes the reference cap (a hot block once failed
/// the whole volume there).
const CI_HOT_SEEDS: u64 = 60;

#[test]
fn simulator_seeds_pass_with_hot_blocks_past_the_reference_cap() {
    let opts = SimOptions { compressible_duplicates: true, ..SimOptions::default() };
    let (total, failures) = run_seeds(20_000..20_000 + CI_HOT_SEEDS, &opts);
    assert!(failures.is_empty(), "{} of {CI_HOT_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.coverage.refcount_cap_copies > 0, "no duplicate reached the reference cap");
}

/// Seeds run rewriting every block found corrupt with its own content, which must then read
/// back (hash verification once shared the damaged copy again). The range holds seeds whose
/// rewrites hit damaged copies.
const CI_HEAL_SEEDS: u64 = 240;

#[test]
fn simulator_seeds_pass_rewriting_damaged_blocks() {
    let opts = SimOptions { heal_rewrites: true, ..SimOptions::default() };
    let (total, failures) = run_seeds(30_000..30_000 + CI_HEAL_SEEDS, &opts);
    assert!(failures.is_empty(), "{} of {CI_HEAL_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.heals > 0, "no damaged block was rewritten");
}

/// Seeds run in CI with write-once journaling on every seed.
const CI_WOJ_SEEDS: u64 = 80;

/// Write-once journaling under crashes and faults: every seed has a random journal range,
/// journal writes and later checkpoint copies of them (some across crashes, some after the
/// journal copy was overwritten or lost), and half the seeds cut the weak hash to 4 bits, so
/// nearly every lookup collides and only the byte comparison stands between a collision and
/// a wrong share. A wrong share reads back wrong data, which fails the seed.
#[test]
fn simulator_seeds_pass_with_woj_and_forced_collisions() {
    let opts = SimOptions { woj_pct: 100, ..SimOptions::default() };
    let start = 20_000;
    let (total, failures) = run_seeds(start..start + CI_WOJ_SEEDS, &opts);
    eprintln!(
        "{CI_WOJ_SEEDS} WOJ seeds: {} checkpoint writes shared, {} collisions refused, {} crashes, {} recoveries",
        total.coverage.woj_hits, total.coverage.woj_collisions, total.crashes, total.recoveries
    );
    assert!(failures.is_empty(), "{} of {CI_WOJ_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.coverage.woj_hits > 0, "no checkpoint write was shared");
    assert!(total.coverage.woj_collisions > 0, "no forced collision reached the byte comparison");
    assert!(total.crashes >= CI_WOJ_SEEDS, "too few crashes: {}", total.crashes);
}

/// Seeds run with recompression (every session stores with the other codec; passes bring
/// it to the volume's codec between operations, a quarter with a crash armed inside).
const CI_RECOMPRESS_SEEDS: u64 = 160;

#[test]
fn simulator_seeds_pass_with_recompression_and_crashes_inside_it() {
    let opts = SimOptions { recompress: true, ..SimOptions::default() };
    let start = 40_000;
    let (total, failures) = run_seeds(start..start + CI_RECOMPRESS_SEEDS, &opts);
    eprintln!(
        "{CI_RECOMPRESS_SEEDS} recompression seeds: {} passes, {} fragments replaced, {} crashes inside them",
        total.recompress_passes, total.fragments_recompressed, total.crashes_in_recompress
    );
    assert!(failures.is_empty(), "{} of {CI_RECOMPRESS_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.fragments_recompressed > 0, "no fragment was recompressed");
    assert!(total.crashes_in_recompress > 0, "no crash struck inside a recompression pass");
}

/// Seeds with combined writes: several small requests written as one batch through the
/// pipeline (the batcher's path), with every fault and crash of the other seeds.
const CI_COMBINED_SEEDS: u64 = 120;

#[test]
fn simulator_seeds_pass_with_combined_writes() {
    let opts = SimOptions { combined_writes: true, ..SimOptions::default() };
    let start = 60_000;
    let (total, failures) = run_seeds(start..start + CI_COMBINED_SEEDS, &opts);
    eprintln!("{CI_COMBINED_SEEDS} combined-write seeds: {} batches, {} crashes", total.combined_writes, total.crashes);
    assert!(failures.is_empty(), "{} of {CI_COMBINED_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.combined_writes > 0, "no combined write ran");
    assert!(total.crashes > 0, "no crash struck");
}

/// Seeds run with extent caps (formatted with a random cap, changed between operations).
const CI_EXTENT_CAP_SEEDS: u64 = 80;

/// The extent cap under crashes and faults: volumes formatted with caps of 1 to 8 blocks or
/// none, and caps changed while open (a quarter with a crash armed inside the superblock
/// write), so data written under one cap is read, shared, cleaned and settled under
/// another; a reopen must find the last acknowledged cap (or the one a failed change
/// tried).
#[test]
fn simulator_seeds_pass_with_extent_caps_changing() {
    let opts = SimOptions { extent_caps: true, recompress: true, ..SimOptions::default() };
    let (total, failures) = run_seeds(50_000..50_000 + CI_EXTENT_CAP_SEEDS, &opts);
    assert!(failures.is_empty(), "{} of {CI_EXTENT_CAP_SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    assert!(total.extent_cap_changes > 0, "no extent cap was changed");
    assert!(total.crashes_in_tune > 0, "no crash struck inside a change");
}
