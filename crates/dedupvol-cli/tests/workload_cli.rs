//! The workload commands end to end through the binary: `gen` writes data with the asked
//! ratios (checked by `estimate`), `estimate --compare-engine` agrees with the engine, `bench`
//! prints its JSON with every section, and bad arguments fail with a clear message.

use std::path::Path;
use std::process::{Command, Output};

fn dedupvol(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("running dedupvol")
}

fn ok_json(args: &[&str]) -> serde_json::Value {
    let out = dedupvol(args);
    assert!(
        out.status.success(),
        "dedupvol {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// `bench ARGS --no-disk --dir DIR --json`: its first scenario.
fn bench_scenario(dir: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--no-disk", "--dir", p(dir), "--json"]);
    ok_json(&all)["scenarios"][0].clone()
}

#[test]
fn gen_then_estimate_finds_the_asked_ratios() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("w.bin");
    ok_json(&["gen", "--preset", "write-high", "--size", "16M", "--seed", "5", "-o", p(&f), "--json"]);
    assert_eq!(std::fs::metadata(&f).expect("stat").len(), 16 << 20);
    let v = ok_json(&["estimate", p(&f), "--json"]);
    let e = &v["estimate"];
    let scanned = e["scanned_bytes"].as_f64().expect("scanned");
    let dup = e["savings_dedup_bytes"].as_f64().expect("dedup") / scanned;
    assert!((dup - 0.8).abs() < 0.02, "dedup share {dup}");
    let unique = e["unique_chunks"].as_f64().expect("unique");
    let payload = e["compressed_payload_bytes"].as_f64().expect("payload");
    let comp = 1.0 - payload / (unique * 4096.0);
    assert!((comp - 0.8).abs() < 0.03, "LZ4 savings {comp}");
}

#[test]
fn estimate_compare_engine_reports_both_sides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("m.bin");
    ok_json(&["gen", "--dup", "50", "--compress", "70", "--zero", "5", "--size", "8M", "-o", p(&f), "--json"]);
    let v = ok_json(&["estimate", p(&f), "--compare-engine", "--dir", p(dir.path()), "--json"]);
    let err = v["engine"]["estimate_error_percent"].as_f64().expect("error percent");
    assert!(err.abs() < 2.0, "estimate off by {err}%: {v}");
    assert_eq!(v["engine"]["savings_dedup_bytes"], v["estimate"]["savings_dedup_bytes"]);
}

#[test]
fn bench_json_has_primitives_engine_baselines_and_io() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = &bench_scenario(dir.path(), &["--mode", "seq", "--size", "8M", "--dup", "75", "--compress", "50"]);
    assert!(s["primitives"]["blake3_mb_s"].as_f64().expect("blake3") > 0.0);
    assert!(s["engine"]["mb_s"].as_f64().expect("engine") > 0.0, "{s}");
    assert!(s["no_reduction_volume"]["mb_s"].as_f64().expect("baseline") > 0.0, "{s}");
    assert!(s["raw_file"]["mb_s"].as_f64().expect("raw") > 0.0);
    assert!(s["stats"]["reduction_ratio"].as_f64().expect("ratio") > 3.0, "{s}");
    assert!(s["io"]["data_write"].as_u64().expect("io") > 0);
    // Nothing is left behind in the benchmark directory.
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

/// Regression: with a zstd level (and a rest level) the no-reduction baseline inherited
/// them, and formatting it failed ("only zstd takes a level"), so the run had no baseline.
#[test]
fn bench_with_a_zstd_level_still_measures_its_no_reduction_baseline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--mode", "seq", "--size", "4M", "--compression", "zstd:6", "--rest-level", "9"];
    let s = &bench_scenario(dir.path(), &args);
    assert!(s["no_reduction_error"].is_null(), "{s}");
    assert!(s["no_reduction_volume"]["mb_s"].as_f64().expect("baseline") > 0.0, "{s}");
}

#[test]
fn bench_overwrite_mode_reports_writes_per_second() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = bench_scenario(dir.path(), &["--mode", "overwrite", "--range", "16M", "--writes", "2000", "--no-baseline"]);
    let e = &s["engine"];
    assert_eq!(e["ops"].as_u64(), Some(2000));
    assert!(e["ops_s"].as_f64().expect("ops/s") > 0.0);
}

/// The overwrite bench's timed-phase I/O counts the timed phase alone: the cleaning and
/// settling after it are background writes, not the client's. (They were once counted in
/// the timed phase, which halved the background-to-client ratio it reported.) What the
/// volume wrote in all, less the timed phase and the passes after it, is the prefill's
/// data: more than nothing, less than its range.
#[test]
fn bench_overwrite_counts_background_writes_apart_from_the_clients() {
    let dir = tempfile::tempdir().expect("tempdir");
    let range = 32u64 << 20;
    let args = "--mode overwrite --dup 68 --compress 68 --range 32M --writes 20000 --no-baseline";
    let s = bench_scenario(dir.path(), &args.split(' ').collect::<Vec<_>>());
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"));
    let b = &s["background"];
    let (client, cleaner_timed, after) = (n(&b["client_bytes"]), n(&b["cleaner_timed_bytes"]), n(&b["after_bytes"]));
    let timed = n(&s["io"]["data_write"]);
    let total = n(&s["stats"]["io"]["data_write"]["bytes"]);
    assert_eq!(timed, client + cleaner_timed, "the timed phase's data writes are the client's and the cleaner's");
    assert!(after > 0, "settling after the timed phase wrote nothing");
    let prefill = total.checked_sub(timed + after).expect("the timed phase counted the writes after it");
    assert!(prefill > 0 && prefill < range, "prefill data {prefill} of {total} written in all");
}

#[test]
fn bad_arguments_fail_with_a_message() {
    for args in [
        vec!["bench", "--dup", "150"],
        vec!["bench", "--request-size", "5000"],
        vec!["gen", "--preset", "oltp", "--size", "1M", "-o", "/dev/null"],
        vec!["estimate", "--chunk-size", "12K", "/dev/null"],
        vec!["estimate", "/nonexistent/file"],
    ] {
        let out = dedupvol(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: no error message: {err}");
    }
}
