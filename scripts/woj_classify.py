#!/usr/bin/env python3
"""Where the device data writes of ext4 data=journal go: a per-block classification.

Runs one workload (4 KiB sequential or random writes with an fsync every N writes) on
ext4 mounted with data=journal on a served volume, like scripts/bench_woj.py, but with a
recording NBD proxy between nbdfuse and the server: every block written is logged (its
address, a content digest, and jbd2 descriptor blocks whole). After umount the log is
replayed offline against the journal range the server found and the file system's layout
(dumpe2fs, debugfs), and every 4 KiB block written is put in one class:

  journal, jbd2 descriptor / commit / revoke / superblock   jbd2's own blocks
  journal copy of file data / of metadata                    a block's journal copy
  checkpoint, shared (one journal copy)                      what WOJ removes
  checkpoint, missed: ...                                    why a checkpoint was stored

A journal copy's home block comes from the descriptor block's tags, so metadata copies
are named (inode table, bitmaps, group descriptors, extent or directory blocks) and
those never checkpointed (superseded by a later copy of the same block in the journal
before the checkpoint) are counted apart. The server's own counters are printed beside
the offline figures as a check (device blocks stored, WOJ shares).

Run as root. Usage:
  scripts/woj_classify.py --workload seq --every 10 --mib 64 [--config woj]
"""

import argparse
import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_woj  # noqa: E402

B = 4096
JBD2_MAGIC = 0xC03B3998
JBD2_KIND = {1: "descriptor", 2: "commit", 3: "superblock", 4: "superblock", 5: "revoke"}
REQ_MAGIC = 0x25609513
IHAVEOPT = b"IHAVEOPT"


class Tap:
    """A TCP proxy for NBD that records every write, zero-write and trim (client side)."""

    def __init__(self, listen_port, server_port, log_path):
        self.server_port = server_port
        self.lock = threading.Lock()
        self.log = open(log_path, "w")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", listen_port))
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.server_port))
            for x in (c, s):
                x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(s, c), daemon=True).start()
            threading.Thread(target=self._client, args=(c, s), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while True:
                d = a.recv(1 << 20)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _client(self, c, s):
        buf = bytearray()

        def need(n):
            while len(buf) < n:
                d = c.recv(1 << 20)
                if not d:
                    raise EOFError
                buf.extend(d)

        def take(n):
            need(n)
            out = bytes(buf[:n])
            del buf[:n]
            s.sendall(out)
            return out

        try:
            take(4)  # client flags
            while True:
                need(8)
                if bytes(buf[:8]) == IHAVEOPT:
                    hdr = take(16)
                    (olen,) = struct.unpack(">I", hdr[12:16])
                    take(olen)
                    continue
                hdr = take(28)
                magic, _flags, typ, _handle, off, length = struct.unpack(">IHHQQI", hdr)
                if magic != REQ_MAGIC:
                    raise RuntimeError(f"tap: lost the request stream (magic {magic:#x})")
                if typ == 1:  # write
                    data = take(length)
                    self._record_write(off, data)
                elif typ in (4, 6):  # trim, write zeroes
                    with self.lock:
                        self.log.write(json.dumps(["Z" if typ == 6 else "T", off, length]) + "\n")
        except (EOFError, OSError):
            pass

    def _record_write(self, off, data):
        blocks = []
        for i in range(0, len(data) - len(data) % B, B):
            blk = data[i:i + B]
            zero = blk.count(0) == B
            magic, kind = struct.unpack(">II", blk[:8])
            jbd2 = kind if magic == JBD2_MAGIC and kind in JBD2_KIND else 0
            blocks.append(["0" if zero else hashlib.blake2b(blk, digest_size=12).hexdigest(), jbd2,
                           blk.hex() if jbd2 == 1 else ""])
        with self.lock:
            self.log.write(json.dumps(["W", off, len(data), blocks]) + "\n")

    def close(self):
        self.sock.close()
        with self.lock:
            self.log.flush()


def layout(disk):
    """Block classes of the file system's metadata, from dumpe2fs."""
    out = subprocess.run(["dumpe2fs", disk], capture_output=True, text=True).stdout
    kinds = {}
    for line in out.splitlines():
        line = line.strip()
        m = re.match(r"Primary superblock at (\d+), Group descriptors at (\d+)-(\d+)", line)
        if m:
            kinds[int(m.group(1))] = "superblock"
            for b in range(int(m.group(2)), int(m.group(3)) + 1):
                kinds[b] = "group descriptors"
        m = re.match(r"Block bitmap at (\d+)", line)
        if m:
            kinds[int(m.group(1))] = "block bitmap"
        m = re.match(r"Inode bitmap at (\d+)", line)
        if m:
            kinds[int(m.group(1))] = "inode bitmap"
        m = re.match(r"Inode table at (\d+)-(\d+)", line)
        if m:
            for b in range(int(m.group(1)), int(m.group(2)) + 1):
                kinds[b] = "inode table"
    feats = ""
    for line in out.splitlines():
        if line.startswith("Journal features:"):
            feats = line
    return kinds, feats


def file_blocks(disk, name):
    """The file's data blocks, and its extent tree blocks (`blocks` lists both)."""
    out = subprocess.run(["debugfs", "-R", f"blocks /{name}", disk], capture_output=True, text=True).stdout
    data = {int(x) for x in out.split()}
    out = subprocess.run(["debugfs", "-R", f"ex /{name}", disk], capture_output=True, text=True).stdout
    tree = set()
    for line in out.splitlines():
        # An index row (level < depth) names the block of the node below it.
        m = re.match(r"\s*(\d+)/\s*(\d+)\s+\d+/\s*\d+\s+\d+\s*-\s*\d+\s+(\d+)", line)
        if m and int(m.group(1)) < int(m.group(2)):
            tree.add(int(m.group(3)))
    return data - tree, tree


def desc_tags(hexblk, csum_v3, bit64):
    """Home block numbers of the journal blocks a descriptor block announces, in order."""
    blk = bytes.fromhex(hexblk)
    pos, homes = 12, []
    tag_size = 16 if csum_v3 else (12 if bit64 else 8)
    while pos + tag_size <= B:
        if csum_v3:
            lo, flags, hi, _ = struct.unpack(">IIII", blk[pos:pos + 16])
        else:
            lo, _csum, flags = struct.unpack(">IHH", blk[pos:pos + 8])
            hi = struct.unpack(">I", blk[pos + 8:pos + 12])[0] if bit64 else 0
        homes.append(lo | (hi << 32 if bit64 else 0))
        pos += tag_size
        if not flags & 2:  # not SAME_UUID: a 16-byte UUID follows
            pos += 16
        if flags & 8:  # LAST_TAG
            break
    return homes


def classify(log_path, jranges, kinds, feats, data_blocks, tree_blocks):
    csum_v3 = "journal_checksum_v3" in feats
    bit64 = "journal_64bit" in feats
    jr = [(r["offset"] // B, (r["offset"] + r["len"]) // B) for r in jranges]

    def in_journal(lba):
        return any(a <= lba < b for a, b in jr)

    def kind_of(home):
        if home is None:
            return "unknown home"
        if home in data_blocks:
            return "file data"
        if home in tree_blocks:
            return "the file's extent tree"
        return kinds.get(home, "other metadata (extent, directory, ...)")

    events = []  # (class key, lba, digest)
    jcontent = {}  # journal lba -> digest (what it holds now)
    holders = defaultdict(set)  # digest -> journal lbas holding it now
    ever_journaled = set()
    used = set()  # digests a checkpoint took (WOJ removes the entry once used)
    seen = set()  # every digest stored so far (what full dedup could find)
    pending_homes = []  # home blocks announced by the last descriptor, for the next journal blocks
    jhome = {}  # journal lba -> home block (from the descriptor)
    jcopy_events = []  # (index in events, journal lba, digest, home)
    checkpointed = Counter()  # digest -> times shared/checkpointed
    for line in open(log_path):
        rec = json.loads(line)
        if rec[0] != "W":
            events.append((f"{'write-zeroes' if rec[0] == 'Z' else 'trim'} (no data)", rec[1] // B, None))
            continue
        _, off, _length, blocks = rec
        for i, (dg, jbd2, hexblk) in enumerate(blocks):
            lba = off // B + i
            if in_journal(lba):
                old = jcontent.pop(lba, None)
                if old is not None:
                    holders[old].discard(lba)
                if dg == "0":
                    events.append(("journal: zeros", lba, None))
                    continue
                if jbd2:
                    events.append((f"journal: jbd2 {JBD2_KIND[jbd2]}", lba, dg))
                    if jbd2 == 1:
                        pending_homes = desc_tags(hexblk, csum_v3, bit64)
                    continue
                home = pending_homes.pop(0) if pending_homes else None
                jhome[lba] = home
                jcontent[lba] = dg
                holders[dg].add(lba)
                ever_journaled.add(dg)
                jcopy_events.append((len(events), lba, dg, home))
                events.append(("journal copy", lba, dg))
                seen.add(dg)
                continue
            if dg == "0":
                events.append(("home: zeros", lba, None))
                continue
            h = holders.get(dg, set())
            if len(h) == 1 and dg not in used:
                key = "checkpoint: shared with its journal copy"
                used.add(dg)
                checkpointed[dg] += 1
            elif len(h) > 1:
                key = "checkpoint missed: content in 2+ journal blocks (pool entry invalid)"
                checkpointed[dg] += 1
            elif dg in used:
                key = "home missed: same content as an earlier checkpoint (pool entry used)"
            elif dg in ever_journaled:
                key = "checkpoint missed: journal copy overwritten before the checkpoint"
                checkpointed[dg] += 1
            elif dg in seen:
                key = "home missed: duplicate of an earlier home write, never journaled"
            else:
                key = "home: never journaled, new content"
            events.append((f"{key} [{kind_of(lba)}]", lba, dg))
            seen.add(dg)
    # Journal copies: of which home block, and whether that copy was ever checkpointed.
    final = Counter()
    for key, lba, dg in events:
        if key != "journal copy":
            final[key] += 1
    for _, lba, dg, home in jcopy_events:
        k = kind_of(home)
        fate = "checkpointed" if checkpointed[dg] > 0 else "superseded or never checkpointed"
        final[f"journal copy of {k}, {fate}"] += 1
    return final


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exe", default=os.path.join(bench_woj.ROOT, "target/release/dedupvol"))
    p.add_argument("--config", default="woj", choices=list(bench_woj.CONFIGS))
    p.add_argument("--workload", default="seq", choices=["seq", "rand"])
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--mib", type=int, default=64, help="seq: file size; rand: file overwritten")
    p.add_argument("--rand-writes", type=int, default=16384)
    p.add_argument("--size", default="4G")
    p.add_argument("--port", type=int, default=10990)
    p.add_argument("--json", help="also write the classification here")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("woj_classify: needs root (mount -o loop)")
    work = tempfile.mkdtemp(prefix="woj-classify-", dir="/tmp")
    log_path = os.path.join(work, "writes.log")
    dedup, woj = bench_woj.CONFIGS[args.config]
    srv = None
    tap = None
    try:
        # The server listens on --port, the tap on --port + 1; nbdfuse talks to the tap.
        tap = Tap(args.port + 1, args.port, log_path)
        srv = bench_woj.Served(args.exe, work, "v", dedup, woj, args.size, args.port, connect_port=args.port + 1)
        name = f"{args.workload}{args.every}"
        if args.workload == "rand":
            srv.mount()
            fd = os.open(os.path.join(srv.mnt, "randfile"), os.O_CREAT | os.O_WRONLY, 0o644)
            for i in range(0, args.mib * 256, 256):
                os.pwrite(fd, os.urandom(1 << 20), i * 4096)
            os.fsync(fd)
            os.close(fd)
            srv.umount()
            name = "randfile"
        with tap.lock:
            tap.log.truncate(0)
            tap.log.seek(0)
        srv.mount()
        s0 = srv.stats()
        if args.workload == "seq":
            bench_woj.w_seq(srv.mnt, args.mib, args.every)
        else:
            bench_woj.w_rand(srv.mnt, args.rand_writes, args.every, args.mib * 256, args.every)
        srv.umount()
        s1 = srv.stats()
        time.sleep(0.5)
        tap.close()
        kinds, feats = layout(srv.disk)
        data_blocks, tree_blocks = file_blocks(srv.disk, name)
        w1 = s1.get("woj") or {}
        final = classify(log_path, w1.get("ranges", []), kinds, feats, data_blocks, tree_blocks)
        total = sum(final.values())
        logical = s1["counters"]["blocks_written"] - s0["counters"]["blocks_written"]
        device = (s1["io"]["data_write"]["bytes"] - s0["io"]["data_write"]["bytes"]) // B
        hits = w1.get("hits", 0) - (s0.get("woj") or {}).get("hits", 0)
        print(f"\n{args.workload} 4K, fsync every {args.every}, {args.mib} MiB"
              f"{'' if args.workload == 'seq' else f', {args.rand_writes} writes'}; config {args.config}; {feats}")
        print(f"server: {logical} blocks written, {device} stored, {hits} WOJ shares "
              f"({100 * (1 - device / logical):.1f}% saved); tap: {total} blocks\n")
        print("| class | blocks | % of all | stored? |")
        print("|---|---|---|---|")
        for k, n in sorted(final.items(), key=lambda kv: -kv[1]):
            stored = "no" if ("shared" in k or "zeros" in k or "no data" in k) else "yes"
            print(f"| {k} | {n} | {100 * n / total:.1f}% | {stored} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "server": {"logical": logical, "device": device, "hits": hits},
                           "classes": final}, f, indent=1)
    finally:
        if srv:
            srv.close()
        if tap:
            tap.close()
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
