//! One `serve` process with several exports, and TLS, driven by the real clients:
//! `nbdinfo --list` names every export, data written to one export never shows in another,
//! a read-only export refuses writes, and over TLS (certificates made by the test) nbdinfo,
//! nbdcopy and qemu-img connect with a client certificate on the allow-list, while a plain
//! client and a client whose certificate is not on the list are refused.

mod nbd_common;
use nbd_common::*;
use std::path::Path;
use std::process::Command;

/// Test certificates in the file names libnbd and QEMU look for in a credentials directory.
struct Pki {
    /// Credentials of an allowed client (`client1`), plus the CA.
    allowed: tempfile::TempDir,
    /// Credentials of a client the allow-list does not name (`intruder`), same CA.
    intruder: tempfile::TempDir,
    /// The server's files.
    server: tempfile::TempDir,
}

fn make_pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "dedupvol test CA");
    ca_params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_key = KeyPair::generate().expect("ca key");
    let ca = ca_params.self_signed(&ca_key).expect("ca cert");

    let mut sp = CertificateParams::new(vec!["localhost".to_string()]).expect("server params");
    sp.subject_alt_names.push(SanType::IpAddress(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)));
    sp.distinguished_name.push(DnType::CommonName, "localhost");
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    sp.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    let server_key = KeyPair::generate().expect("server key");
    let server_cert = sp.signed_by(&server_key, &ca, &ca_key).expect("server cert");

    let client = |name: &str| {
        let mut cp = CertificateParams::new(vec![name.to_string()]).expect("client params");
        cp.distinguished_name.push(DnType::CommonName, name);
        cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        cp.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let key = KeyPair::generate().expect("client key");
        let cert = cp.signed_by(&key, &ca, &ca_key).expect("client cert");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("ca-cert.pem"), ca.pem()).expect("write");
        std::fs::write(dir.path().join("client-cert.pem"), cert.pem()).expect("write");
        std::fs::write(dir.path().join("client-key.pem"), key.serialize_pem()).expect("write");
        dir
    };
    let server = tempfile::tempdir().expect("tempdir");
    std::fs::write(server.path().join("ca-cert.pem"), ca.pem()).expect("write");
    std::fs::write(server.path().join("server-cert.pem"), server_cert.pem()).expect("write");
    std::fs::write(server.path().join("server-key.pem"), server_key.serialize_pem()).expect("write");
    Pki { allowed: client("client1"), intruder: client("intruder"), server }
}

fn format_named(dir: &Path, name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    run(Command::new(dedupvol()).arg("format").arg(&path).args(["--logical-size", "64M", "--physical-size", "64M"]));
    path
}

fn port_of(server: &ServerProc) -> String {
    server.tcp.as_deref().and_then(|a| a.rsplit(':').next()).expect("tcp address").to_string()
}

#[test]
fn several_exports_are_listed_kept_apart_and_read_only_per_export() {
    if !require_engine("several_exports", &["nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let a = format_named(dir.path(), "alpha.img");
    let b = format_named(dir.path(), "beta.img");
    let c = format_named(dir.path(), "gamma.img");
    let server = ServerProc::start(
        &a,
        dir.path(),
        true,
        &[
            &format!("db={}", b.display()),
            c.to_str().expect("utf-8"),
            "--read-only-export",
            "gamma",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let metrics_addr = server
        .next_line()
        .strip_prefix("dedupvol: metrics on http://")
        .and_then(|r| r.strip_suffix("/metrics"))
        .expect("metrics line")
        .to_string();
    assert!(server.ready_line.contains("alpha (67108864 bytes), db (67108864 bytes), gamma"), "{}", server.ready_line);
    let base = format!("nbd://{}", server.tcp.as_deref().expect("tcp"));
    let list = run(Command::new("nbdinfo").args(["--list", &base]));
    for name in ["alpha", "db", "gamma"] {
        assert!(list.contains(&format!("export=\"{name}\"")), "{name} missing from:\n{list}");
    }
    // Write a pattern to "db" only; "alpha" stays zeros.
    let pattern = dir.path().join("pattern");
    let bytes: Vec<u8> = (0..1 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&pattern, &bytes).expect("write");
    run(Command::new("nbdcopy").arg(&pattern).arg(format!("{base}/db")));
    let back = dir.path().join("back");
    run(Command::new("nbdcopy").arg(format!("{base}/db")).arg(&back));
    let got = std::fs::read(&back).expect("read");
    assert_eq!(got.get(..bytes.len()), Some(&bytes[..]), "db reads back what was written");
    run(Command::new("nbdcopy").arg(format!("{base}/alpha")).arg(&back));
    assert!(std::fs::read(&back).expect("read").iter().all(|&x| x == 0), "alpha is untouched");
    // The default (empty) name is the first export.
    let size = run(Command::new("nbdinfo").args(["--size", &format!("{base}/")]));
    assert_eq!(size.trim(), "67108864");
    // gamma is read-only, the others are not.
    let info = run(Command::new("nbdinfo").args(["--json", &format!("{base}/gamma")]));
    assert!(info.contains("\"is_read_only\": true"), "{info}");
    let info = run(Command::new("nbdinfo").args(["--json", &format!("{base}/db")]));
    assert!(info.contains("\"is_read_only\": false"), "{info}");
    let out = Command::new("nbdcopy").arg(&pattern).arg(format!("{base}/gamma")).output().expect("nbdcopy");
    assert!(!out.status.success(), "a write to a read-only export must fail");
    // One metrics endpoint for all three, every series labelled with its export.
    let (_, _, metrics) = http_get(&metrics_addr, "/metrics");
    for name in ["alpha", "db", "gamma"] {
        let series = format!("dedupvol_logical_size_bytes{{export=\"{name}\"}} 67108864");
        assert!(metrics.contains(&series), "{series} missing from:\n{metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("dedupvol_nbd_requests_total{export=\"db\",command=\"write\"}") && !l.ends_with(" 0")
        ),
        "db's writes are counted under its label:\n{metrics}"
    );
    assert!(server.stop().success(), "clean stop");
    // Each volume was closed cleanly and holds what it was sent.
    for v in [&a, &b, &c] {
        let check = Command::new(dedupvol()).arg("check").arg(v).output().expect("check");
        assert!(check.status.success(), "check {}: {}", v.display(), String::from_utf8_lossy(&check.stdout));
    }
}

#[test]
fn tls_with_an_allow_list_admits_named_clients_only() {
    if !require_engine("tls_allow_list", &["nbdinfo", "nbdcopy", "qemu-img"]) {
        return;
    }
    let pki = make_pki();
    let dir = tempfile::tempdir().expect("tempdir");
    let a = format_named(dir.path(), "alpha.img");
    let b = format_named(dir.path(), "beta.img");
    let s = pki.server.path();
    let server = ServerProc::start(
        &a,
        dir.path(),
        true,
        &[
            b.to_str().expect("utf-8"),
            "--tls-cert",
            s.join("server-cert.pem").to_str().expect("utf-8"),
            "--tls-key",
            s.join("server-key.pem").to_str().expect("utf-8"),
            "--tls-client-ca",
            s.join("ca-cert.pem").to_str().expect("utf-8"),
            "--tls-allow",
            "client1",
        ],
    );
    let port = port_of(&server);
    let tls_uri =
        |name: &str, creds: &Path| format!("nbds://localhost:{port}/{name}?tls-certificates={}", creds.display());

    // An allowed client lists, writes and reads back over TLS.
    let list = run(Command::new("nbdinfo").args(["--list", &tls_uri("", pki.allowed.path())]));
    assert!(list.contains("export=\"alpha\"") && list.contains("export=\"beta\""), "{list}");
    let pattern = dir.path().join("pattern");
    let bytes: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    std::fs::write(&pattern, &bytes).expect("write");
    run(Command::new("nbdcopy").arg(&pattern).arg(tls_uri("beta", pki.allowed.path())));
    let back = dir.path().join("back");
    run(Command::new("nbdcopy").arg(tls_uri("beta", pki.allowed.path())).arg(&back));
    assert_eq!(std::fs::read(&back).expect("read").get(..bytes.len()), Some(&bytes[..]), "TLS round trip");

    // qemu-img with x509 credentials.
    let qemu = run(Command::new("qemu-img").args([
        "info",
        "--output=json",
        "--object",
        &format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", pki.allowed.path().display()),
        "--image-opts",
        &format!("driver=nbd,server.type=inet,server.host=localhost,server.port={port},export=alpha,tls-creds=tls0"),
    ]));
    assert!(qemu.contains("\"virtual-size\": 67108864"), "{qemu}");

    // A plain client is refused (TLS required), and so is a certificate not on the list.
    let plain =
        Command::new("nbdinfo").args(["--size", &format!("nbd://localhost:{port}/alpha")]).output().expect("nbdinfo");
    assert!(!plain.status.success(), "a plain client must be refused");
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(err.to_lowercase().contains("tls"), "the refusal says TLS is required: {err}");
    let intruder =
        Command::new("nbdinfo").args(["--size", &tls_uri("alpha", pki.intruder.path())]).output().expect("nbdinfo");
    assert!(!intruder.status.success(), "a certificate off the allow-list must be refused");
    // The server is still serving the allowed client after the refusals.
    let size = run(Command::new("nbdinfo").args(["--size", &tls_uri("alpha", pki.allowed.path())]));
    assert_eq!(size.trim(), "67108864");
    assert!(server.stop().success(), "clean stop");
}

#[test]
fn plain_nbd_beyond_loopback_is_refused_without_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vol = dir.path().join("v.img");
    std::fs::write(&vol, b"").expect("touch");
    let out = Command::new(dedupvol())
        .arg("serve")
        .arg(&vol)
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .expect("run dedupvol serve");
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs TLS") && err.contains("--insecure"), "{err}");
}
