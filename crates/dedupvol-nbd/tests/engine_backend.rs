//! The server over the real engine, in process: pipelined unaligned writes through two
//! connections, flush on one, clean stop, `close()`, reopen, and every byte reads back.

mod common;
use common::*;
use dedupvol_core::{FormatOptions, MemStorage, OpenOptions, Storage, Volume};
use dedupvol_nbd::proto::*;
use dedupvol_nbd::{ConnectionLimits, ExportConfig, ListenAddr, Server, ServerConfig};
use std::sync::Arc;

fn serve(
    vol: Arc<Volume>,
    dir: &std::path::Path,
) -> (std::path::PathBuf, dedupvol_nbd::StopHandle, std::thread::JoinHandle<()>) {
    let socket = dir.join("engine.sock");
    let config = ServerConfig { connections_max: 4, limits: ConnectionLimits::default(), tls: None };
    let export = ExportConfig { name: "vol".into(), description: None, read_only: false };
    let server = Server::bind(&ListenAddr::Unix(socket.clone()), config).expect("bind");
    let stop = server.stop_handle().expect("stop");
    let t = std::thread::spawn(move || {
        server.run(export, vol).expect("run");
    });
    (socket, stop, t)
}

fn content(i: u64, len: usize) -> Vec<u8> {
    // Every third request repeats request 0's bytes, so the engine's dedup path runs too.
    let key = if i.is_multiple_of(3) { 0 } else { i };
    (0..len).map(|j| (key as usize * 31 + j / 512) as u8).collect()
}

#[test]
fn engine_round_trip_through_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    let fmt = FormatOptions { logical_size_bytes: 32 << 20, ..FormatOptions::default() };
    Volume::format(storage.clone(), None, &fmt, false).expect("format");
    let vol = Arc::new(Volume::open(storage.clone(), None, &OpenOptions::default()).expect("open"));
    let (socket, stop, t) = serve(vol.clone(), dir.path());

    let mut a = connect_raw(&socket);
    let mut b = connect_raw(&socket);
    assert_eq!(go(&mut a, "vol").0, 32 << 20);
    go(&mut b, "vol");
    const N: u64 = 40;
    const LEN: usize = 3 * 4096 + 1000;
    for i in 0..N {
        let s = if i % 2 == 0 { &mut a } else { &mut b };
        send_request(
            s,
            CMD_WRITE,
            if i % 7 == 0 { CMD_FLAG_FUA } else { 0 },
            i,
            7 + i * LEN as u64,
            LEN as u32,
            &content(i, LEN),
        );
    }
    for i in 0..N {
        let s = if i % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(read_reply(s).0, 0, "write {i}");
    }
    send_request(&mut b, CMD_WRITE_ZEROES, 0, 900, 7 + LEN as u64, 4096, &[]);
    assert_eq!(read_reply(&mut b), (0, 900));
    send_request(&mut a, CMD_FLUSH, 0, 901, 0, 0, &[]);
    assert_eq!(read_reply(&mut a), (0, 901));
    // Zero-length requests of every kind succeed and change nothing.
    for (cookie, kind) in [(902, CMD_WRITE), (903, CMD_TRIM), (904, CMD_WRITE_ZEROES), (905, CMD_READ)] {
        send_request(&mut a, kind, 0, cookie, 4096, 0, &[]);
        assert_eq!(read_reply(&mut a), (0, cookie), "zero-length command {kind}");
    }
    send_request(&mut a, CMD_DISC, 0, 0, 0, 0, &[]);
    drop(b);
    stop.stop().unwrap();
    t.join().unwrap();
    let vol = Arc::try_unwrap(vol).ok().expect("server released the volume");
    vol.close().expect("close");

    let vol = Arc::new(Volume::open(storage, None, &OpenOptions::default()).expect("reopen"));
    let mut buf = vec![0u8; LEN];
    for i in 0..N {
        vol.read(7 + i * LEN as u64, &mut buf).unwrap();
        let mut want = content(i, LEN);
        if i == 1 {
            want[..4096].fill(0);
        }
        assert!(buf == want, "request {i} reads back differently after reopen");
    }
    assert!(vol.stats().savings.dedup_bytes > 0 || vol.stats().reduction_ratio > 1.0);
}
