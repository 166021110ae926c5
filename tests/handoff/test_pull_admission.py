"""The resident producer's admission (muser_cli.handoff.pull.admission.Admission): one request at
a time on torch/MLX, up to the compute's ``max_concurrent`` on a batching engine (vLLM), and a
link probe always alone -- never measured against a running prefill, never slowing one."""

from __future__ import annotations

import threading
import time

from muser_cli.handoff.pull.admission import Admission as _Admission
from muser_cli.pulllane.producer import ResidentProducer
from handoff_kit import HANG_S


def test_one_slot_admits_one_request_at_a_time():
    adm = _Admission(1)
    assert adm.enter(False) and not adm.enter(False) and not adm.enter(True)
    adm.leave(False)
    assert adm.enter(False)


def test_slots_admit_that_many_requests_and_a_probe_only_alone():
    adm = _Admission(3)
    assert [adm.enter(False) for _ in range(4)] == [True, True, True, False]
    assert not adm.enter(True)  # requests compute: the probe waits
    for _ in range(3):
        adm.leave(False)
    assert adm.enter(True)
    assert not adm.enter(False) and not adm.enter(True)  # the probe runs alone
    adm.leave(True)
    assert adm.enter(False)


def test_a_waiting_probe_is_not_starved_by_new_requests():
    adm = _Admission(2)
    assert adm.enter(False)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(adm.enter(True, timeout=HANG_S)))
    t.start()
    deadline = time.monotonic() + HANG_S
    while not adm._probe_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not adm.enter(False)  # a free slot, but a probe waits for the running one to end
    adm.leave(False)
    t.join(HANG_S)
    assert got == [True]
    adm.leave(True)


def test_a_probe_waiting_the_servers_way_holds_requests_back_between_polls():
    """``wait`` (what a queued connection runs) keeps the probe's mark for the whole wait:
    across many short polls no new request gets in, and the probe runs once the running
    request leaves; a stopping server ends the wait with False."""
    adm = _Admission(2)
    assert adm.enter(False)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(adm.wait(True, lambda: False, poll=0.01)))
    t.start()
    deadline = time.monotonic() + HANG_S
    while not adm._probe_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(30):  # 0.3 s: some 30 of the probe's polls
        assert not adm.enter(False)
        time.sleep(0.01)
    adm.leave(False)
    t.join(HANG_S)
    assert got == [True] and adm._probing
    stopping = threading.Event()
    t2 = threading.Thread(target=lambda: got.append(adm.wait(False, stopping.is_set, poll=0.01)))
    t2.start()
    time.sleep(0.05)
    stopping.set()
    t2.join(HANG_S)
    assert got == [True, False]
    adm.leave(True)


def test_torch_producer_computes_one_request_at_a_time(tiny_llama):
    prod = ResidentProducer(str(tiny_llama.path), engine="torch", dtype="float32", max_batch=8)
    assert prod.max_concurrent == 1 and prod._batcher is None


def test_max_batch_below_one_is_a_usage_error_before_anything_loads():
    from typer.testing import CliRunner

    from muser_cli.commands import app

    r = CliRunner().invoke(app, ["prefill", "--serve", "127.0.0.1:0", "--engine", "vllm", "--max-batch", "0"])
    assert r.exit_code == 2 and "--max-batch must be >= 1" in r.output, r.output
