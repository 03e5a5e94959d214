//! Regression test: `bench --volume PATH` formatted PATH without asking, destroying an
//! existing volume or any other data there. It now refuses a path holding a dedupvol
//! volume or data unless `--force`, and leaves it untouched.
use std::process::Command;

fn dedupvol(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("run dedupvol")
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

const SMALL_BENCH: [&str; 8] = ["--mode", "seq", "--size", "4M", "--no-baseline", "--no-disk", "--threads", "1"];

#[test]
fn bench_refuses_a_volume_or_data_without_force() {
    let dir = tempfile::tempdir().expect("tmp");
    let vol = dir.path().join("v.img");
    let v = vol.to_str().expect("utf8");
    let o = dedupvol(&["format", v, "--logical-size", "64M", "--physical-size", "64M"]);
    assert!(o.status.success(), "{}", text(&o));
    let before = std::fs::read(&vol).expect("read");
    let mut args = vec!["bench", "--volume", v];
    args.extend_from_slice(&SMALL_BENCH);
    let o = dedupvol(&args);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("holds a dedupvol volume") && text(&o).contains("--force"), "{}", text(&o));
    assert!(std::fs::read(&vol).expect("read") == before, "the refused volume was touched");

    let data = dir.path().join("data.bin");
    std::fs::write(&data, vec![7u8; 1 << 20]).expect("write");
    let d = data.to_str().expect("utf8");
    let mut args = vec!["bench", "--volume", d];
    args.extend_from_slice(&SMALL_BENCH);
    let o = dedupvol(&args);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("holds data"), "{}", text(&o));
    assert_eq!(std::fs::read(&data).expect("read"), vec![7u8; 1 << 20], "the refused file was touched");

    // --force overwrites; a new path needs nothing.
    args.push("--force");
    let o = dedupvol(&args);
    assert!(o.status.success(), "{}", text(&o));
    let fresh = dir.path().join("new.img");
    let mut args = vec!["bench", "--volume", fresh.to_str().expect("utf8")];
    args.extend_from_slice(&SMALL_BENCH);
    let o = dedupvol(&args);
    assert!(o.status.success(), "{}", text(&o));
}
