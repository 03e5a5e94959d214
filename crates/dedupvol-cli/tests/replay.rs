//! Trace generation and replay end to end through the binary: a generated trace reports its
//! reference skew, replays against a file, a volume and an NBD server with every read
//! verified, the volume dedups where the trace repeats contents, and a malformed trace
//! fails naming the file and line.

mod nbd_common;
use nbd_common::{format_volume, in_memory, ServerProc};
use std::path::Path;
use std::process::{Command, Output};

/// Records of the generated trace.
const OPS: u64 = 20_000;

fn dedupvol(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(args).output().expect("running dedupvol")
}

fn ok(args: &[&str]) -> String {
    let out = dedupvol(args);
    assert!(
        out.status.success(),
        "dedupvol {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn ok_json(args: &[&str]) -> serde_json::Value {
    let text = ok(args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("JSON from {args:?}: {e}\n{text}"))
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Generates the test trace over `blocks` 4 KiB blocks; returns its statistics.
fn generate(trace: &Path, blocks: u64) -> serde_json::Value {
    let v = ok_json(&[
        "trace",
        "generate",
        p(trace),
        "--ops",
        &OPS.to_string(),
        "--seed",
        "11",
        "--blocks",
        &blocks.to_string(),
        "--json",
    ]);
    let st = v["stats"].clone();
    assert_eq!(st["records"].as_u64(), Some(OPS), "{v}");
    // The same figures as `trace stats` computes from the file.
    let again = ok_json(&["trace", "stats", p(trace), "--json"]);
    assert_eq!(again["stats"], st);
    st
}

/// Checks a replay report: every record replayed, as many reads and writes as the trace
/// has, every read verified (the trace only reads what it wrote).
fn check_report(r: &serde_json::Value, stats: &serde_json::Value) {
    let reads = stats["reads"].as_u64().expect("reads");
    let writes = stats["writes"].as_u64().expect("writes");
    assert_eq!(r["records"].as_u64(), Some(OPS), "{r}");
    assert_eq!(r["reads"]["ops"].as_u64(), Some(reads), "{r}");
    assert_eq!(r["writes"]["ops"].as_u64(), Some(writes), "{r}");
    assert_eq!(r["writes"]["bytes"].as_u64(), Some(writes * 4096), "{r}");
    assert_eq!(r["verify"].as_bool(), Some(true), "{r}");
    assert_eq!(r["verified_blocks"].as_u64(), Some(reads), "{r}");
    let p50 = r["all"]["p50_us"].as_f64().expect("p50");
    let p99 = r["all"]["p99_us"].as_f64().expect("p99");
    let max = r["all"]["max_us"].as_f64().expect("max");
    assert!(p50 > 0.0 && p50 <= p99 && p99 <= max, "{r}");
}

#[test]
fn generated_trace_replays_onto_a_file_with_verification() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("t.fiu");
    let stats = generate(&trace, 16384);
    let share = |k: &str| stats[k].as_f64().expect(k);
    assert!((share("chunks_refs_over_10") - 0.06).abs() <= 0.025, "{stats}");
    assert!((share("chunks_refs_over_5") - 0.045).abs() <= 0.025, "{stats}");
    assert!((share("accesses_to_refs_over_5") - 0.42).abs() <= 0.12, "{stats}");
    let file = dir.path().join("f.img");
    std::fs::File::create(&file).expect("create");
    let target = format!("file:{}", p(&file));
    let r = ok_json(&["replay", p(&trace), "--target", &target, "--json"]);
    check_report(&r, &stats);
    // The table names each kind with its count.
    let table = ok(&["replay", p(&trace), "--target", &target, "--queue-depth", "2"]);
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} row in\n{table}"))
    };
    assert_eq!(row("read"), stats["reads"].as_u64().expect("reads"), "{table}");
    assert_eq!(row("write"), stats["writes"].as_u64().expect("writes"), "{table}");
    assert_eq!(row("all"), OPS, "{table}");
    // --limit-ops replays a prefix; native timing takes at least the prefix's time span
    // (fast, these 500 requests take a few milliseconds; at 2000 IOPS they span ~0.25 s).
    let r = ok_json(&["replay", p(&trace), "--target", &target, "--limit-ops", "500", "--timing", "native", "--json"]);
    assert_eq!(r["all"]["ops"].as_u64(), Some(500), "{r}");
    let text = std::fs::read_to_string(&trace).expect("read trace");
    let ts: Vec<u64> =
        text.lines().take(500).map(|l| l.split_whitespace().next().and_then(|t| t.parse().ok()).expect("ts")).collect();
    let span_s = (ts[499] - ts[0]) as f64 / 1e9;
    let took = r["seconds"].as_f64().expect("seconds");
    assert!(span_s > 0.1 && took >= span_s * 0.99, "native replay took {took} s for a {span_s} s trace: {r}");
}

#[test]
fn generated_trace_replays_onto_a_volume_which_dedups_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("t.fiu");
    // A large address space: overwrites are rare, so each repeated content is a dedup hit.
    let stats = generate(&trace, 1 << 18);
    let vol = dir.path().join("v.img");
    ok(&["format", p(&vol), "--logical-size", "1G", "--physical-size", "128M"]);
    let target = format!("vol:{}", p(&vol));
    let r = ok_json(&["replay", p(&trace), "--target", &target, "--json"]);
    check_report(&r, &stats);
    let s = ok_json(&["stats", p(&vol), "--json"]);
    let writes = stats["writes"].as_u64().expect("writes");
    let unique = stats["unique_chunks"].as_u64().expect("unique");
    assert_eq!(s["lifetime"]["blocks_written"].as_u64(), Some(writes), "{s}");
    let hits = s["lifetime"]["dedup_hits"].as_u64().expect("dedup hits");
    // Every write of an already written content is a hit, except where an overwrite freed
    // the content in between.
    let repeats = writes - unique;
    assert!(hits <= repeats && hits as f64 >= 0.95 * repeats as f64, "{hits} dedup hits for {repeats} repeats: {s}");
}

#[test]
fn warmup_writes_make_reads_of_unwritten_blocks_verifiable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("mid.fiu");
    // As in a trace cut from a longer one: blocks 3 and 4 are read before any write.
    std::fs::write(
        &trace,
        "100 1 a 24 8 R 8 0 11111111111111111111111111111111\n\
         200 1 a 32 8 R 8 0 22222222222222222222222222222222\n\
         300 1 a 24 8 W 8 0 33333333333333333333333333333333\n\
         400 1 a 24 8 R 8 0 33333333333333333333333333333333\n\
         500 1 a 32 8 R 8 0 22222222222222222222222222222222\n",
    )
    .expect("write trace");
    let file = dir.path().join("f.img");
    std::fs::File::create(&file).expect("create");
    let target = format!("file:{}", p(&file));
    let cold = ok_json(&["replay", p(&trace), "--target", &target, "--json"]);
    assert_eq!(cold["warmup_blocks"].as_u64(), Some(0), "{cold}");
    assert_eq!(cold["verified_blocks"].as_u64(), Some(1), "{cold}");
    let warm = ok_json(&["replay", p(&trace), "--target", &target, "--warmup-writes", "--json"]);
    assert_eq!(warm["warmup_blocks"].as_u64(), Some(2), "{warm}");
    assert_eq!(warm["verified_blocks"].as_u64(), Some(4), "{warm}");
    assert_eq!(warm["records"].as_u64(), Some(5), "{warm}");
}

#[test]
fn malformed_traces_fail_naming_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("bad.fiu");
    std::fs::write(
        &trace,
        "100 1 a 24 8 W 8 0 11111111111111111111111111111111\n\n200 1 a 32 8 Q 8 0 22222222222222222222222222222222\n",
    )
    .expect("write trace");
    let file = dir.path().join("f.img");
    std::fs::File::create(&file).expect("create");
    for args in
        [vec!["trace", "stats", p(&trace)], vec!["replay", p(&trace), "--target", &format!("file:{}", p(&file))]]
    {
        let out = dedupvol(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(&format!("{}:3: field op is \"Q\", expected R or W", p(&trace))), "{args:?}: {err}");
    }
    // A target string that is none of the forms is a usage error.
    let out = dedupvol(&["replay", p(&trace), "--target", "tape:/dev/st0"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn generated_trace_replays_over_nbd_with_verification() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("t.fiu");
    let stats = generate(&trace, 16384);
    let vol = format_volume(dir.path(), "64M", "64M");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let r = ok_json(&["replay", p(&trace), "--target", &srv.uri, "--verify", "--queue-depth", "4", "--json"]);
    check_report(&r, &stats);
    assert!(r["target"].as_str().is_some_and(|t| t.contains("4 connections")), "{r}");
    let status = srv.stop();
    assert!(status.success(), "server exit {status:?}");
    if !in_memory() {
        // Every write of the replay reached the volume behind the server.
        let s = ok_json(&["stats", p(&vol), "--json"]);
        assert_eq!(s["lifetime"]["blocks_written"].as_u64(), stats["writes"].as_u64(), "{s}");
    }
    // The same over TCP, for a prefix.
    let srv = ServerProc::start(&vol, dir.path(), true, &[]);
    assert!(srv.uri.starts_with("nbd://"), "{}", srv.uri);
    let r = ok_json(&["replay", p(&trace), "--target", &srv.uri, "--verify", "--limit-ops", "3000", "--json"]);
    assert_eq!(r["all"]["ops"].as_u64(), Some(3000), "{r}");
    assert_eq!(r["verified_blocks"], r["reads"]["ops"], "{r}");
    let status = srv.stop();
    assert!(status.success(), "server exit {status:?}");
}

/// Whether process `pid` blocks SIGINT (the replay does once it watches for signals).
fn blocks_sigint(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (libc::SIGINT - 1)) != 0)
}

#[test]
fn sigint_stops_a_native_replay_and_closes_the_volume_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("slow.fiu");
    // Three records a minute apart: native timing waits between them.
    std::fs::write(
        &trace,
        "0 1 a 0 8 W 8 0 11111111111111111111111111111111\n\
         60000000000 1 a 8 8 W 8 0 22222222222222222222222222222222\n\
         120000000000 1 a 0 8 R 8 0 11111111111111111111111111111111\n",
    )
    .expect("write trace");
    let vol = dir.path().join("v.img");
    ok(&["format", p(&vol), "--logical-size", "64M", "--physical-size", "64M"]);
    let target = format!("vol:{}", p(&vol));
    let child = Command::new(env!("CARGO_BIN_EXE_dedupvol"))
        .args(["replay", p(&trace), "--target", &target, "--timing", "native", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn replay");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !blocks_sigint(child.id()) {
        assert!(std::time::Instant::now() < deadline, "the replay never started watching for signals");
        std::thread::yield_now();
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGINT), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("JSON: {e}: {err}"));
    assert_eq!(r["interrupted"].as_bool(), Some(true), "{r}");
    assert!(r["records"].as_u64().is_some_and(|n| n < 3), "{r}");
    let s = ok_json(&["stats", p(&vol), "--json"]);
    assert_eq!(s["lifetime"]["recoveries"].as_u64(), Some(0), "the volume was not closed cleanly: {s}");
}
