//! The admin socket and the metrics endpoint of `dedupvol serve`: `stats` on a served
//! volume answers from the server (live counters, `--watch` frames), the socket goes away
//! with the server, a socket left by a killed server does not block the next one, and
//! `--metrics` serves OpenMetrics text whose key series parse and move with I/O.

mod nbd_common;
use nbd_common::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;

/// `dedupvol CMD VOL ARGS`, reaching a server of `dir`'s runtime directory if one serves it.
fn run_on(cmd: &str, vol: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(dedupvol())
        .arg(cmd)
        .arg(vol)
        .args(args)
        .env("DEDUPVOL_RUNTIME_DIR", runtime_dir(dir))
        .output()
        .unwrap_or_else(|e| panic!("run {cmd}: {e}"))
}

fn stats(vol: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    run_on("stats", vol, dir, args)
}

fn stats_json(vol: &Path, dir: &Path) -> serde_json::Value {
    let out = stats(vol, dir, &["--json"]);
    assert!(out.status.success(), "stats failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stats json")
}

fn command<'a>(j: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    j["server"]["commands"].as_array().unwrap().iter().find(|c| c["command"] == name).unwrap()
}

fn sockets(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(runtime_dir(dir))
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "sock")).collect())
        .unwrap_or_default()
}

#[test]
fn stats_of_a_served_volume_asks_the_server() {
    if !require_engine("stats_of_a_served_volume_asks_the_server", &["nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "8M", "32M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "32M"]);
    assert_eq!(sockets(dir.path()).len(), 1, "one admin socket while serving");
    let idle = stats_json(&vol, dir.path());
    assert_eq!(command(&idle, "write")["requests"], 0);
    assert_eq!(idle["logical_bytes_used"], 0);

    let input = dir.path().join("in.raw");
    std::fs::write(&input, make_data(srv.size as usize, 5)).unwrap();
    run(Command::new("nbdcopy").arg(&input).arg(&srv.uri));
    let busy = stats_json(&vol, dir.path());
    assert!(command(&busy, "write")["requests"].as_u64().unwrap() > 0, "{busy}");
    assert_eq!(command(&busy, "write")["bytes"].as_u64().unwrap(), srv.size);
    assert!(busy["logical_bytes_used"].as_u64().unwrap() > 0);
    assert!(busy["server"]["connections_accepted"].as_u64().unwrap() >= 1);
    assert_eq!(busy["pid"].as_u64().unwrap(), u64::from(srv.child.as_ref().unwrap().id()));

    let human = stats(&vol, dir.path(), &[]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(human.status.success() && text.starts_with("served by pid "), "{text}");
    assert!(text.contains("refcount histogram"), "{text}");

    let watch = stats(&vol, dir.path(), &["--watch", "--interval", "0.2", "--count", "3"]);
    let text = String::from_utf8_lossy(&watch.stdout);
    assert!(watch.status.success(), "{}", String::from_utf8_lossy(&watch.stderr));
    assert_eq!(text.matches("served by pid").count(), 3, "{text}");
    assert!(text.contains("req/s"), "later frames show rates: {text}");

    assert!(srv.stop().success());
    assert!(sockets(dir.path()).is_empty(), "the admin socket goes with the server");
    // Not served: the volume itself is read, and --watch says why it cannot run.
    let closed = stats_json(&vol, dir.path());
    assert!(closed.get("server").is_none());
    assert_eq!(closed["refcount_histogram"], busy["refcount_histogram"], "same histogram, served or not");
    assert_eq!(closed["logical_bytes_used"], busy["logical_bytes_used"]);
    let watch = stats(&vol, dir.path(), &["--watch", "--count", "1"]);
    assert_eq!(watch.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&watch.stderr).contains("is not being served"));
}

#[test]
fn a_killed_servers_admin_socket_does_not_block_the_next() {
    if !require_engine("a_killed_servers_admin_socket_does_not_block_the_next", &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "8M", "32M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "32M"]);
    srv.kill9();
    assert_eq!(sockets(dir.path()).len(), 1, "a killed server leaves its socket behind");
    // Nobody answers on it: stats reads the volume (after its journal replay, read-only).
    assert!(stats(&vol, dir.path(), &["--json"]).status.success());
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "32M"]);
    let j = stats_json(&vol, dir.path());
    assert_eq!(j["pid"].as_u64().unwrap(), u64::from(srv.child.as_ref().unwrap().id()));
    assert!(srv.stop().success());
    assert!(sockets(dir.path()).is_empty());
}

/// Parses OpenMetrics text: series (name with labels) → value. Checks the shape of every
/// line on the way, so a malformed exposition fails here.
fn parse(text: &str) -> HashMap<String, f64> {
    assert!(text.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
    let mut out = HashMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ")
                    || line.starts_with("# TYPE ")
                    || line.starts_with("# UNIT ")
                    || line == "# EOF",
                "bad comment line {line:?}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value in {line:?}"));
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            name.starts_with("dedupvol_") && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad metric name in {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unterminated labels in {line:?}");
        }
        let v: f64 = if value == "+Inf" {
            f64::INFINITY
        } else {
            value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"))
        };
        assert!(out.insert(series.to_string(), v).is_none(), "duplicate series {series}");
    }
    out
}

#[test]
fn metrics_endpoint_serves_openmetrics_that_moves_with_io() {
    if !require_engine("metrics_endpoint_serves_openmetrics_that_moves_with_io", &["nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = format_volume(dir.path(), "8M", "32M");
    let srv = ServerProc::start(&vol, dir.path(), false, &["--cache-size", "32M", "--metrics", "127.0.0.1:0"]);
    let line = srv.next_line();
    let addr = line
        .strip_prefix("dedupvol: metrics on http://")
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected metrics line {line:?}"))
        .to_string();

    let (status, headers, body) = http_get(&addr, "/metrics");
    assert!(status.contains(" 200 "), "{status}");
    assert!(headers.contains("content-type: application/openmetrics-text"), "{headers}");
    let before = parse(&body);
    for key in [
        "dedupvol_logical_size_bytes",
        "dedupvol_physical_free_bytes",
        "dedupvol_space_saving_percent",
        "dedupvol_savings_bytes{mechanism=\"dedup\"}",
        "dedupvol_blocks_written_total{outcome=\"compressed\"}",
        "dedupvol_device_io_bytes_total{category=\"journal\",direction=\"write\"}",
        "dedupvol_cache_lookups_total{cache=\"block_map\",result=\"hit\"}",
        "dedupvol_nbd_requests_total{command=\"block_status\"}",
        "dedupvol_errors_total{kind=\"checksum\"}",
        "dedupvol_refcount_blocks{refs_max=\"1\"}",
        "dedupvol_tier_enabled",
        "dedupvol_nbd_request_duration_seconds_count{command=\"write\"}",
        "dedupvol_nbd_connections_open",
    ] {
        assert!(before.contains_key(key), "series {key} missing from:\n{body}");
    }
    assert_eq!(before["dedupvol_logical_size_bytes"], srv.size as f64);
    assert_eq!(before["dedupvol_nbd_requests_total{command=\"write\"}"], 0.0);

    let input = dir.path().join("in.raw");
    std::fs::write(&input, make_data(srv.size as usize, 9)).unwrap();
    run(Command::new("nbdcopy").arg("--flush").arg(&input).arg(&srv.uri));
    let after = parse(&http_get(&addr, "/metrics").2);
    let grew = |k: &str| {
        assert!(after[k] > before[k], "{k} did not grow: {} -> {}", before[k], after[k]);
    };
    grew("dedupvol_nbd_requests_total{command=\"write\"}");
    grew("dedupvol_nbd_request_bytes_total{command=\"write\"}");
    grew("dedupvol_nbd_request_duration_seconds_count{command=\"write\"}");
    grew("dedupvol_nbd_requests_total{command=\"flush\"}");
    grew("dedupvol_logical_used_bytes");
    grew("dedupvol_physical_used_bytes");
    grew("dedupvol_device_io_bytes_total{category=\"data\",direction=\"write\"}");
    grew("dedupvol_nbd_connections_total");
    assert!(after["dedupvol_physical_free_bytes"] < before["dedupvol_physical_free_bytes"]);
    // The latency buckets are cumulative and end with +Inf holding the count.
    assert_eq!(
        after["dedupvol_nbd_request_duration_seconds_bucket{le=\"+Inf\",command=\"write\"}"],
        after["dedupvol_nbd_request_duration_seconds_count{command=\"write\"}"]
    );

    // Every series the Grafana dashboard queries exists, so the dashboard cannot drift
    // from the exposition.
    let dashboard =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana-dashboard.json")).unwrap();
    let names: std::collections::HashSet<&str> = after.keys().map(|k| k.split('{').next().unwrap()).collect();
    let mut queried = 0;
    for (i, _) in dashboard.match_indices("dedupvol_") {
        let name: String = dashboard[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if name == "dedupvol_" {
            continue;
        }
        queried += 1;
        assert!(names.contains(name.as_str()), "the dashboard queries {name}, which the endpoint does not serve");
    }
    assert!(queried > 20, "found only {queried} series in the dashboard");

    let (status, _, _) = http_get(&addr, "/nothing");
    assert!(status.contains(" 404 "), "{status}");
    // A request head past the bound is refused, and the endpoint keeps answering.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    let _ = write!(s, "GET /metrics HTTP/1.1\r\nX-Long: {}\r\n\r\n", "a".repeat(16 << 10));
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    drop(s);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(s, "POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 405 "), "{answer}");
    assert!(http_get(&addr, "/metrics").0.contains(" 200 "));
    assert!(srv.stop().success());
    assert!(std::net::TcpStream::connect(&addr).is_err(), "the endpoint goes with the server");
}

/// `tune --rest-level` on a closed volume, then on a served one (its server changes it:
/// no second opener takes the lock), and its refusals: the level is kept, visible in
/// `stats`, and survives the server's stop.
#[test]
fn tune_sets_the_rest_level_closed_or_served() {
    if !require_engine("tune_sets_the_rest_level_closed_or_served", &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("vol.img");
    let tune = small_volume_to_tune(&vol, dir.path(), &["--rest-level", "off"]);
    assert_eq!(stats_json(&vol, dir.path())["rest_level"], 0);
    let closed = tune_json(&tune(&["--rest-level", "3", "--json"]));
    assert_eq!((closed["rest_level_before"].as_i64(), closed["rest_level_after"].as_i64()), (Some(0), Some(3)));
    assert_eq!(closed["online"], false);
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let served = tune_json(&tune(&["--rest-level", "5", "--json"]));
    assert_eq!((served["rest_level_before"].as_i64(), served["rest_level_after"].as_i64()), (Some(3), Some(5)));
    assert_eq!(served["online"], true);
    assert_eq!(stats_json(&vol, dir.path())["rest_level"], 5);
    refused(
        &tune,
        &[
            (&["--rest-level", "off"], "cannot be taken away"),
            (&["--rest-level", "20"], "from 1 to 19"),
            (&["--rest-level", "fast"], "a zstd level"),
        ],
    );
    assert!(srv.stop().success());
    assert_eq!(stats_json(&vol, dir.path())["rest_level"], 5, "kept after the server stopped");
    let text = String::from_utf8_lossy(&tune(&["--rest-level", "5"]).stdout).to_string();
    assert!(text.contains("zstd level 5 -> zstd level 5"), "{text}");
}

/// `format --extent-max` and `tune --extent-max` on a closed volume, then on a served one
/// (through its server), its refusals, and `info`/`stats` showing it; the rest level is
/// left alone by a tune that names only the extent cap.
#[test]
fn the_extent_cap_is_set_at_format_and_tuned_closed_or_served() {
    if !require_engine("the_extent_cap_is_set_at_format_and_tuned_closed_or_served", &[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("vol.img");
    let tune = small_volume_to_tune(&vol, dir.path(), &["--extent-max", "16K"]);
    assert_eq!(stats_json(&vol, dir.path())["extent_blocks_max"], 4);
    let closed = tune_json(&tune(&["--extent-max", "32K", "--json"]));
    assert_eq!(
        (closed["extent_blocks_max_before"].as_u64(), closed["extent_blocks_max_after"].as_u64()),
        (Some(4), Some(8))
    );
    assert!(closed.get("rest_level_after").is_none(), "{closed}");
    let srv = ServerProc::start(&vol, dir.path(), false, &[]);
    let served = tune_json(&tune(&["--extent-max", "4K", "--json"]));
    assert_eq!(
        (served["extent_blocks_max_before"].as_u64(), served["extent_blocks_max_after"].as_u64()),
        (Some(8), Some(1))
    );
    assert_eq!(served["online"], true);
    assert_eq!(stats_json(&vol, dir.path())["extent_blocks_max"], 1);
    refused(
        &tune,
        &[
            (&["--extent-max", "68K"], "from 4K to 64K"),
            (&["--extent-max", "6K"], "in steps of 4K"),
            (&["--extent-max", "0"], "from 4K"),
            (&[], "required"),
        ],
    );
    assert!(srv.stop().success());
    assert_eq!(stats_json(&vol, dir.path())["extent_blocks_max"], 1, "kept after the server stopped");
    assert_eq!(stats_json(&vol, dir.path())["rest_level"], 6, "the rest level untouched");
    let info = Command::new(dedupvol()).arg("info").arg(&vol).output().expect("info");
    assert!(String::from_utf8_lossy(&info.stdout).contains("extents         up to 4 KiB"), "{info:?}");
    let text = String::from_utf8_lossy(&tune(&["--extent-max", "64K"]).stdout).to_string();
    assert!(text.contains("largest extent 4 KiB -> 64 KiB"), "{text}");
}

/// `dedupvol tune VOL ARGS`, reaching a server of `dir`'s runtime directory if one serves it.
fn tune(vol: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    run_on("tune", vol, dir, args)
}

/// The JSON report of a `tune --json` that succeeded.
fn tune_json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "tune failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("tune json")
}

/// Formats a small volume at `vol` with `extra` format arguments; returns `tune` on it.
fn small_volume_to_tune<'a>(
    vol: &'a std::path::Path,
    dir: &'a std::path::Path,
    extra: &[&str],
) -> impl Fn(&[&str]) -> std::process::Output + 'a {
    run(Command::new(dedupvol())
        .arg("format")
        .arg(vol)
        .args(["--logical-size", "8M", "--physical-size", "32M"])
        .args(extra));
    move |args: &[&str]| tune(vol, dir, args)
}

/// Each `tune` argument list fails, its message naming why.
fn refused(tune: &impl Fn(&[&str]) -> std::process::Output, cases: &[(&[&str], &str)]) {
    for (args, why) in cases {
        let o = tune(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why), "{args:?}: {err}");
    }
}
