//! `dedupvol model` on fixed rates: the arithmetic of the comparison (a CPU-bound row
//! doubles with the cores until the SSDs bind, and the bound is named), the JSON document,
//! a rates file saved and read back, and bad parameters refused with a usage error that
//! names the parameter.

use std::path::Path;
use std::process::Command;

/// Rates with round numbers: a unique block costs 0.8 µs of BLAKE3, 0.2 of crc32c, 0.5 of
/// probe and 3.5 of zstd, 0.5 of metadata: 5.5 µs, 744.7 MB/s per core.
const RATES: &str = r#"{
  "version": 1,
  "measured_on": "fixed rates of the test",
  "blake3_mb_s": 5120.0,
  "crc32c_mb_s": 20480.0,
  "probe_mb_s": 8192.0,
  "zstd_compress_mb_s": 1170.2857142857142,
  "zstd_decompress_mb_s": 4096.0,
  "lz4_compress_mb_s": 4096.0,
  "lz4_decompress_mb_s": 8192.0,
  "write_metadata_us_per_block": 0.5,
  "write_unique_metadata_us_per_block": 0.5,
  "read_metadata_us_per_block": 0.25
}"#;

fn dedupvol() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dedupvol"))
}

fn model(rates: &Path, extra: &[&str]) -> std::process::Output {
    let mut c = dedupvol();
    c.arg("model").arg("--rates").arg(rates);
    c.args(extra);
    c.output().expect("run dedupvol model")
}

fn rates_file(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("rates.json");
    std::fs::write(&p, RATES).expect("write rates");
    p
}

#[test]
fn cpu_bound_rows_scale_with_cores_until_the_ssds_bind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rates = rates_file(dir.path());
    let out = model(
        &rates,
        &[
            "--json",
            "--dup",
            "0",
            "--compress",
            "50",
            "--cores",
            "1,2,64",
            "--ssds",
            "2",
            "--metadata",
            "nvdimm",
            "--volumes",
            "64",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = doc["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 3);
    let mb_s = |i: usize| rows[i]["throughput_mb_s"].as_f64().expect("throughput");
    let bound = |i: usize| rows[i]["bound"].as_str().expect("bound").to_string();
    assert!((mb_s(0) - 4096.0 / 5.5).abs() < 1e-6, "{}", mb_s(0));
    assert_eq!(bound(0), "cpu-compression");
    assert!((mb_s(1) - 2.0 * mb_s(0)).abs() < 1e-6, "{} vs {}", mb_s(1), mb_s(0));
    assert_eq!(bound(1), "cpu-compression");
    // Two SSDs at 2000 MB/s, half of every logical byte stored: 8000 MB/s.
    assert!((mb_s(2) - 8000.0).abs() < 1e-6, "{}", mb_s(2));
    assert_eq!(bound(2), "data-devices");
    assert_eq!(doc["input"]["rates"]["measured_on"], "fixed rates of the test");
}

#[test]
fn the_table_names_bounds_and_rates_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rates = rates_file(dir.path());
    let saved = dir.path().join("saved.json");
    let out = model(&rates, &["--dup", "0", "--save-rates", saved.to_str().expect("utf8"), "--remote-mb-s", "2500"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in ["CPU: compression", "RADOS", "SSD + NVDIMM", "$/usable TB", "fixed rates of the test"] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    let a: serde_json::Value = serde_json::from_str(RATES).expect("rates");
    let b: serde_json::Value = serde_json::from_slice(&std::fs::read(&saved).expect("saved")).expect("saved json");
    assert_eq!(a, b);
}

#[test]
fn bad_parameters_are_usage_errors_that_name_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rates = rates_file(dir.path());
    let bad_rates = dir.path().join("bad.json");
    std::fs::write(&bad_rates, RATES.replace("5120.0", "-1.0")).expect("write");
    let not_json = dir.path().join("not.json");
    std::fs::write(&not_json, "hello").expect("write");
    let cases: &[(&Path, &[&str], &str)] = &[
        (&rates, &["--dup", "120"], "--dup 120"),
        (&rates, &["--dup", "100"], "--dup"),
        (&rates, &["--zero", "100"], "--zero"),
        (&rates, &["--compress", "100"], "--compress"),
        (&rates, &["--read=-5"], "--read"),
        (&rates, &["--cores", "0"], "--cores"),
        (&rates, &["--ssds", "4,0"], "--ssds"),
        (&rates, &["--ssd-tb", "0"], "--ssd-tb"),
        (&rates, &["--price-core=-3"], "--price-core"),
        (&rates, &["--remote-mb-s", "0"], "--remote-mb-s"),
        (&rates, &["--content-cache", "lots"], "--content-cache"),
        (&bad_rates, &[], "blake3_mb_s"),
        (&not_json, &[], "not a rates file"),
    ];
    for (file, args, want) in cases {
        let out = model(file, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: no {want:?} in {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let out = model(&dir.path().join("missing.json"), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
}

#[test]
fn the_help_states_the_formulas() {
    let out = dedupvol().args(["model", "--help"]).output().expect("help");
    let text = String::from_utf8_lossy(&out.stdout);
    for want in ["CPU bound = cores", "lock bound", "usable TB", "--price-nvdimm-gb", "Sizing model"] {
        assert!(text.contains(want), "no {want:?} in the help");
    }
}
