"""Issue 25 item 3: one exit-status enum, one table from Reject codes to errors.

The statuses are the product's contract (docs/cli-contract.md); a peer's ``Reject(model)`` is
mismatched data (65) on both lanes and on either side, like a pack made for another model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from muser_cli import errors
from muser_cli.errors import ExitStatus, IdentityMismatch
from muser_cli.handoff.wire.protocol import REJECT_CODES, Reject

ROOT = Path(__file__).resolve().parents[2]


def test_every_error_class_exits_with_a_member_of_the_one_enum():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.MuserError)]
    assert len(classes) >= 12
    for cls in classes:
        assert type(cls.exit_status) is ExitStatus, cls


def test_the_enum_is_the_contracts_table():
    text = (ROOT / "docs" / "cli-contract.md").read_text()
    table = {int(m) for m in re.findall(r"^\| (\d+) \|", text, flags=re.M)}
    assert table == {int(s) for s in ExitStatus}


def test_no_literal_exit_status_in_the_library_or_the_commands():
    """Done-when of item 3: every exit status is written as ExitStatus (errors.py alone holds the numbers)."""
    literal = re.compile(r"(Exit|exit)\(\s*\d|exit_status\s*[:=][^=\n]*\b\d+\b|\b(returncode|exit_code)\s*==?\s*\d"
                         r"|\bEXIT_[A-Z_]+\s*=\s*\d|[\"']exit(_status)?[\"']\s*:\s*\d"
                         r"|\bstatus\b[\w, ]*=\s*(0|1|2|65|66|75|76|77|78|130)\b|return (0|1) if .* else (0|1)\b")
    found = []
    for base in ("muser_cli", "commands"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if "commands" in path.relative_to(ROOT).parts[1:] or path.name == "errors.py":
                continue  # muser_cli/commands is the link to commands/
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if literal.search(line.split("#", 1)[0]):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("code", REJECT_CODES)
def test_one_table_every_side_agrees(code):
    """The sender (link), the consumer (pull_client), a receiver cut mid-stream (receipt) and a
    refusal raised on this side (refusal_error) give one class for each Reject code."""
    from muser_cli.handoff.link import reject_error
    from muser_cli.handoff.pull.client import _refused
    from muser_cli.handoff.push.receipt import stream_failure
    from muser_cli.handoff.wire.refusal import REJECT_ERRORS, Refusal, refusal_error

    want = REJECT_ERRORS[code]
    got = {type(reject_error(Reject(code, "x"))), type(_refused(Reject(code, "x"), "p:1")),
           type(stream_failure(Refusal(code, "x"), 3)), type(refusal_error(Refusal(code, "x")))}
    assert got == {want}


def test_a_model_refusal_is_mismatched_data_65_on_both_lanes():
    from muser_cli.handoff.link import reject_error
    from muser_cli.handoff.pull.client import _refused

    for exc in (reject_error(Reject("model", "serves sha256:a")), _refused(Reject("model", "serves sha256:a"), "p:1")):
        assert isinstance(exc, IdentityMismatch) and exc.exit_status == ExitStatus.DATA == 65


def test_a_producer_of_another_model_is_dropped_from_the_pool_as_its_docstring_says():
    """The pool's rule: one that refused us for good (authentication, another model) is dropped;
    a refusal of one request (a DataError about the job) is not held against it."""
    from muser_cli.consumer.pool import ProducerPool
    from muser_cli.handoff.pull.client import _refused

    pool = ProducerPool(["127.0.0.1:1"])
    addr = pool.pick()
    pool.done(addr, _refused(Reject("model", "this producer serves sha256:b"), addr))
    assert pool.pick() is None and "model" in pool.to_json()[0]["gone"]
