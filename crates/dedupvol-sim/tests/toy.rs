//! The simulator proves itself on a toy engine: the correct toy passes every seed, and each
//! deliberately broken toy is caught within a few seeds. Without this a green simulator run
//! could mean a checker that cannot fail.

use dedupvol_sim::{run_seed, set_toy_bug, SimOptions, ToyBug, ToyVolume};

/// Seeds each broken toy gets to be caught in.
const SEEDS_TO_CATCH_BUG_MAX: u64 = 40;

fn first_failure(bug: ToyBug, opts: &SimOptions) -> Option<(u64, String)> {
    set_toy_bug(bug);
    let r = (0..SEEDS_TO_CATCH_BUG_MAX).find_map(|s| run_seed::<ToyVolume>(s, opts).err().map(|f| (s, f.message)));
    set_toy_bug(ToyBug::None);
    r
}

// One test function: the toy's bug switch is process-global and tests run in parallel.
#[test]
fn correct_toy_passes_and_every_broken_toy_is_caught() {
    let opts = SimOptions::default();
    set_toy_bug(ToyBug::None);
    for seed in 0..60 {
        if let Err(f) = run_seed::<ToyVolume>(seed, &opts) {
            panic!("correct toy engine failed:\n{f}");
        }
    }
    for bug in [ToyBug::FlushWithoutSync, ToyBug::HeaderBeforeDataSync, ToyBug::NoReadChecksum] {
        let caught = first_failure(bug, &opts);
        assert!(caught.is_some(), "toy bug {bug:?} was not caught in {SEEDS_TO_CATCH_BUG_MAX} seeds");
        if let Some((seed, msg)) = caught {
            eprintln!("toy bug {bug:?} caught by seed {seed}: {msg}");
        }
    }
}

#[test]
fn same_seed_same_trace() {
    let opts = SimOptions::default();
    for seed in [3, 17, 99] {
        let a = run_seed::<ToyVolume>(seed, &opts).map_err(|f| f.to_string());
        let b = run_seed::<ToyVolume>(seed, &opts).map_err(|f| f.to_string());
        let (a, b) = (a.expect("run a"), b.expect("run b"));
        assert_eq!(a.trace, b.trace, "seed {seed}: two runs made different I/O");
        assert_eq!(a.faults, b.faults, "seed {seed}: two runs injected different faults");
    }
}
