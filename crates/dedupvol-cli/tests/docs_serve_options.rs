//! docs/nbd.md's option table lists every option `dedupvol serve --help` shows.
//!
//! The bug this pins: the table had fallen behind the server (`--io`, `--cache-size`,
//! `--cache-writes` and `--index-memory` were missing), so readers of the doc could not
//! find options that decide the server's memory and speed.
use std::process::Command;

#[test]
fn nbd_doc_lists_every_serve_option() {
    let o = Command::new(env!("CARGO_BIN_EXE_dedupvol")).args(["serve", "--help"]).output().expect("run dedupvol");
    assert!(o.status.success(), "serve --help failed");
    let help = String::from_utf8_lossy(&o.stdout);
    let options: Vec<&str> = help
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("--")))
        .map(|w| w.trim_end_matches(','))
        .filter(|w| *w != "--help" && *w != "--version")
        .collect();
    assert!(options.len() >= 10, "could not read the options from serve --help:\n{help}");
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/nbd.md")).expect("docs/nbd.md");
    let missing: Vec<&&str> =
        options.iter().filter(|opt| !doc.lines().any(|l| l.starts_with(&format!("| `{opt}")))).collect();
    assert!(missing.is_empty(), "docs/nbd.md's option table lacks {missing:?}");
}
