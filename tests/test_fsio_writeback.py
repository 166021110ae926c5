"""Early writeback: the disk starts on a file while it is being written; a failure fails the write."""

from __future__ import annotations

import os
import time

import pytest

from muser_cli import fsio
from handoff_kit import HANG_S


def test_early_writeback_syncs_while_writing_and_keeps_every_byte(tmp_path):
    path = tmp_path / "big.bin"
    step = 1 << 20
    blocks = [os.urandom(256 << 10) for _ in range(16)]  # 4 MiB: several steps
    with open(path, "wb") as f:
        with fsio.EarlyWriteback(f.fileno(), step=step, poll_s=0.001) as early:
            for b in blocks:
                f.write(b)
                f.flush()
                time.sleep(0.005)  # a writer that computes between writes
        early.close()
        os.fsync(f.fileno())
    assert early.syncs >= 2  # flushed while the writer was still going
    assert path.read_bytes() == b"".join(blocks)


def test_a_failed_early_flush_fails_the_write(tmp_path):
    f = open(tmp_path / "x.bin", "wb")  # noqa: SIM115 - closed under the watcher on purpose
    early = fsio.EarlyWriteback(f.fileno(), step=1, poll_s=0.001)
    f.close()  # the fd goes away under the watcher: its next fstat fails (EBADF)
    deadline = time.monotonic() + HANG_S
    while early.error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(OSError):
        early.close()


def test_atomic_writer_publishes_a_large_file_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(fsio, "WRITEBACK_STEP", 1 << 20)
    data = os.urandom(3 << 20)
    out = tmp_path / "out.bin"
    with fsio.atomic_writer(out) as fh:
        for i in range(0, len(data), 64 << 10):
            fh.write(data[i : i + (64 << 10)])
    assert out.read_bytes() == data
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_a_spool_whose_publish_fails_leaves_no_part(tmp_path):
    """The receiver's spool: a publish that fails before its rename (here the early flush
    met a closed fd) is refused, and discard removes the part -- nothing unverifiable stays."""
    from muser_cli.handoff.push.spool import FileSink

    sink = FileSink(tmp_path / "x.kvpack")
    sink.write(os.urandom(1 << 16), 0)
    os.close(sink._f.fileno())  # the fd goes away under the sink
    with pytest.raises(OSError):
        sink.publish()
    sink.discard()
    assert list(tmp_path.iterdir()) == []
