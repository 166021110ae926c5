"""docs/reliability.md E29-E33: the replay ledger is durable before the receiver acknowledges."""

from __future__ import annotations

import contextlib
import errno
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from muser_cli import fsio
from muser_cli.errors import AuthError, TempFailure
from muser_cli.handoff.trust.ledger import Ledger, LedgerError, LedgerFull, Record, repair
from muser_cli.handoff.push.receiver import Destination, ReceiveConfig, Receiver
from muser_cli.handoff.push.sender import prepare_handoff, transmit

from kvpack_factory import make_pack
from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, copy_home, env_for, ledger_records, muser_cmd, nodes, pack_bytes, pack_file, receivers,
)


def rec(i: int) -> Record:
    return Record(f"{i:032x}", 1_700_000_000_000 + i, 1_700_000_000_500 + i, 1000 + i, "ab" * 32)


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class SimulatedCrash(BaseException):
    """The machine lost power inside fsync: nothing after this point ran."""


# ----------------------------------------------------------------------------- E29
@pytest.mark.parametrize("torn", [False, True])
def test_e29_lost_unsynced_writes(tmp_path, monkeypatch, torn):
    durable: dict[int, int] = {}  # inode -> bytes known durable (size at the last good fsync)
    armed = {"crash": False}
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if armed["crash"] and fd_path(fd).endswith(".ledger"):
            raise SimulatedCrash()
        real_fsync(fd)
        st = os.fstat(fd)
        durable[st.st_ino] = st.st_size

    monkeypatch.setattr(os, "fsync", fsync)
    led = Ledger(tmp_path, "k1").open()
    acked = []
    for i in range(5):
        led.commit(rec(i))  # returned: the receiver may now acknowledge
        acked.append(rec(i).handoff_id)
    armed["crash"] = True
    with pytest.raises(SimulatedCrash):
        led.commit(rec(5))  # written to the page cache, never synced, never acknowledged
    led.close()
    monkeypatch.setattr(os, "fsync", real_fsync)

    # The crash: unsynced bytes are lost, or (torn) half of them reached the disk.
    path = tmp_path / "k1.ledger"
    keep = durable[path.stat().st_ino]
    lost_line = rec(5).line()
    with open(path, "r+b") as f:
        f.truncate(keep)
        if torn:
            f.seek(keep)
            f.write(lost_line[: len(lost_line) // 2])
    if torn:
        with pytest.raises(LedgerError, match="torn") as exc:
            Ledger(tmp_path, "k1").open()
        assert "repair-ledger k1" in (exc.value.hint or "")
        assert repair(tmp_path, "k1")["dropped_bytes"] == len(lost_line) // 2

    led2 = Ledger(tmp_path, "k1").open()
    assert all(i in led2 for i in acked), "an acknowledged handoff was forgotten"
    assert rec(5).handoff_id not in led2
    for i in range(5):
        with pytest.raises(AuthError, match="replay"):
            led2.commit(rec(i))  # none accepted twice
    led2.commit(rec(5))  # never acknowledged before: accepted now, exactly once
    with pytest.raises(AuthError):
        led2.commit(rec(5))
    assert len(led2) == 6


# ----------------------------------------------------------------------------- E30
def test_e30_fsync_eio_unit_no_retry(tmp_path, monkeypatch):
    led = Ledger(tmp_path, "k1").open()
    led.commit(rec(0))
    calls = []
    real_fsync = os.fsync

    def failing(fd):
        if fd_path(fd).endswith(".ledger"):
            calls.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(LedgerError, match="fsync failed"):
        led.commit(rec(1))
    assert len(calls) == 1
    monkeypatch.setattr(os, "fsync", real_fsync)  # the disk "recovers": still no accept
    with pytest.raises(LedgerError, match="unusable"):
        led.commit(rec(2))
    with pytest.raises(LedgerError):
        led.seen(rec(0).handoff_id)
    assert len(calls) == 1, "fsync was retried"


def test_e30_fsync_eio_receiver_fails_closed(nodes, pack_file, receivers, tmp_path, monkeypatch):
    run = receivers(nodes.consumer, tmp_path)
    first = prepare_handoff(pack_file, nodes.producer)
    assert transmit(first, to=run.to, identity=nodes.producer).ok  # ledger file exists now
    real_fsync = os.fsync

    def failing(fd):
        if fd_path(fd).endswith(".ledger"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    prep = prepare_handoff(pack_file, nodes.producer)
    with pytest.raises(TempFailure, match="storage"):
        transmit(prep, to=run.to, identity=nodes.producer)
    run.wait_done()
    assert isinstance(run.error, LedgerError)  # the receiver stopped; exit 78 from the CLI
    assert run.error.exit_status == 78
    assert not (run.out_dir / f"{prep.header.handoff_id}.kvpack").exists()
    assert not list(run.out_dir.glob(".*.part"))
    with pytest.raises(TempFailure):
        transmit(prepare_handoff(pack_file, nodes.producer), to=run.to, identity=nodes.producer, connect_s=1)


# ----------------------------------------------------------------------------- E31
def test_e31_fsync_of_files_and_directories(nodes, pack_file, receivers, tmp_path, monkeypatch):
    log: list[tuple[str, str]] = []
    real_fsync, real_dir = os.fsync, fsio.fsync_dir

    def spy_fsync(fd):
        log.append(("file", fd_path(fd)))
        real_fsync(fd)

    def spy_dir(directory):
        log.append(("dir", str(Path(directory).resolve())))
        real_dir(directory)

    real_replace = os.replace

    def spy_replace(a, b):
        log.append(("rename", str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(fsio, "fsync_dir", spy_dir)
    monkeypatch.setattr(os, "replace", spy_replace)
    run = receivers(nodes.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nodes.producer)
    res = transmit(prep, to=run.to, identity=nodes.producer)
    assert res.ok
    final = str((run.out_dir / f"{prep.header.handoff_id}.kvpack").resolve())
    ledger_dir = str(run.ledger_dir.resolve())
    out_dir = str(run.out_dir.resolve())

    def index(pred) -> int:
        return next(i for i, e in enumerate(log) if pred(e))

    created_dir = index(lambda e: e == ("dir", ledger_dir))  # new ledger file's name made durable
    record = max(i for i, e in enumerate(log) if e[0] == "file" and e[1].endswith(f"{prep.header.key_id}.ledger"))
    spool = index(lambda e: e[0] == "file" and e[1].endswith(".part") and e[1].startswith(out_dir))
    rename = index(lambda e: e == ("rename", str(run.out_dir / f"{prep.header.handoff_id}.kvpack")))
    published = index(lambda e: e == ("dir", out_dir))
    assert created_dir < record < spool < rename < published, log
    assert Path(final).read_bytes() == pack_file.read_bytes()


# ----------------------------------------------------------------------------- E32
@contextlib.contextmanager
def tiny_fs(path: Path, size: str = "64k"):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_e32_disk_full_on_spool(nodes, tmp_path):
    big, _, _ = make_pack(600)
    small, _, _ = make_pack(60, seed=1)
    (tmp_path / "big.kvpack").write_bytes(big)
    (tmp_path / "small.kvpack").write_bytes(small)
    assert len(big) > 64 * 1024 > len(small)
    with tiny_fs(tmp_path / "fs") as fs:
        r = Receiver(nodes.consumer, ReceiveConfig(port=0, once=False, idle_s=3), ledger_dir=tmp_path / "ledger",
                     destination=Destination(directory=fs))
        from handoff_kit import RunningReceiver  # noqa: F401
        import threading

        r.bind()
        to = f"127.0.0.1:{r.address[1]}"
        t = threading.Thread(target=r.serve, daemon=True)
        t.start()
        try:
            prep = prepare_handoff(tmp_path / "big.kvpack", nodes.producer)
            with pytest.raises(TempFailure, match="storage"):
                transmit(prep, to=to, identity=nodes.producer)
            assert list(fs.iterdir()) == []  # the spool file was removed
            assert ledger_records(tmp_path / "ledger", prep.header.key_id) == []
            ok = transmit(prepare_handoff(tmp_path / "small.kvpack", nodes.producer), to=to, identity=nodes.producer)
            assert ok.ok and len(list(fs.iterdir())) == 1  # still serving once space allows
        finally:
            r.close()
            t.join(HANG_S)


def test_e32_disk_full_on_ledger(nodes, pack_file, tmp_path):
    with tiny_fs(tmp_path / "fs", size="16k") as fs:
        led = Ledger(fs, "k1").open()
        i = 0
        while (fs / "k1.ledger").stat().st_size < 4096 - 200:
            led.commit(rec(i))
            i += 1
        filler = fs / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)  # take every free page
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        size_before = (fs / "k1.ledger").stat().st_size
        with pytest.raises(LedgerFull):
            for j in range(i, i + 10):  # the record crossing into a new page cannot be written
                led.commit(rec(j))
        failed = j
        assert (fs / "k1.ledger").stat().st_size <= size_before + 4096
        led.close()
        reopened = Ledger(fs, "k1").open()  # not torn: the partial write was cut back
        assert rec(failed).handoff_id not in reopened
        filler.unlink()
        reopened.commit(rec(failed))
        assert rec(failed).handoff_id in reopened


# ----------------------------------------------------------------------------- E33
def test_e33_torn_record_refuses_until_repaired(nodes, pack_file, tmp_path):
    home = copy_home(nodes.consumer_home, tmp_path / "consumer")
    ledger_dir = home / "data" / "ledger"
    key_id = nodes.producer_key_id
    led = Ledger(ledger_dir, key_id).open()
    led.commit(rec(1))
    led.close()
    with open(ledger_dir / f"{key_id}.ledger", "ab") as f:
        f.write(rec(2).line()[:40])  # torn: no newline, CRC cannot match

    with pytest.raises(LedgerError, match="torn"):
        Receiver(nodes.consumer, ReceiveConfig(port=0), ledger_dir=ledger_dir, destination=Destination(directory=tmp_path))

    env = env_for(home)
    r = subprocess.run(muser_cmd("receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "5", "-o",
                                 str(tmp_path / "x.kvpack")), env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 78, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"muser node repair-ledger {key_id}" in lines[0]
    assert not (tmp_path / "x.kvpack").exists()

    r = subprocess.run(muser_cmd("node", "repair-ledger", key_id), env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "40 torn bytes removed" in r.stderr
    led = Ledger(ledger_dir, key_id).open()
    assert rec(1).handoff_id in led and rec(2).handoff_id not in led


def test_e33_corruption_inside_is_not_repaired_in_place(tmp_path):
    led = Ledger(tmp_path, "k1").open()
    for i in range(3):
        led.commit(rec(i))
    led.close()
    p = tmp_path / "k1.ledger"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(LedgerError, match="corrupt"):
        Ledger(tmp_path, "k1").open()
    with pytest.raises(LedgerError, match="not at the tail"):
        repair(tmp_path, "k1")


# ----------------------------------------------------------------------------- concurrency, timing
def test_two_ledger_handles_cannot_both_accept(tmp_path):
    a, b = Ledger(tmp_path, "k1").open(), Ledger(tmp_path, "k1").open()
    a.commit(rec(7))
    with pytest.raises(AuthError):
        b.commit(rec(7))  # b re-reads under the lock and sees a's record


def test_ledger_commit_latency(tmp_path, capsys):
    led = Ledger(tmp_path, "k1").open()
    times = sorted(led.commit(rec(i)) * 1000 for i in range(200))
    p50, p99 = statistics.median(times), times[int(0.99 * len(times)) - 1]
    with capsys.disabled():
        print(f"\n[ledger] commit (write + fsync) over 200 records: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    assert p50 < 1000
    assert time.monotonic() > 0
