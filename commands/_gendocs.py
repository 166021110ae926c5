"""Generate shell completions, man pages and docs/cli.md from the Typer app itself.

    python -m muser_cli.commands._gendocs           # write
    python -m muser_cli.commands._gendocs --check   # exit 1 if anything is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer.main
from typer._completion_shared import get_completion_script

from muser_cli.about import __version__
from muser_cli.commands import app
from muser_cli.commands._examples import EXAMPLES
from muser_cli.errors import ExitStatus

ROOT = Path(__file__).resolve().parent.parent
PROG = "muser"
COMPLETE_VAR = "_MUSER_COMPLETE"


def _cli():
    return typer.main.get_command(app)  # type: ignore[return-value]


def completions() -> dict[str, str]:
    cli = _cli()
    out = {}
    del cli  # Typer's scripts call back into `muser` for candidates, so they are static
    for shell, name in (("bash", "muser.bash"), ("zsh", "_muser"), ("fish", "muser.fish")):
        script = get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell)
        out[f"completions/{name}"] = script.rstrip() + "\n"
    return out


def _roff(text: str) -> str:
    return text.replace("\\", "\\\\").replace("-", "\\-").replace("\n.", "\n\\&.")


def _params(cmd) -> list[tuple[str, str]]:
    ctx = cmd.context_class(cmd, info_name=cmd.name)
    rows = []
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        record = p.get_help_record(ctx)
        if record:
            rows.append((record[0], record[1]))
    return rows


def _usage(cmd, path: str) -> str:
    ctx = cmd.context_class(cmd, info_name=path)
    return " ".join(cmd.collect_usage_pieces(ctx))


def _subcommands(cmd) -> list[tuple[str, object]]:
    """The subcommands of a command group (``muser node ...``, ``muser reuse ...``), by name."""
    return sorted(getattr(cmd, "commands", {}).items())


def _options_table(cmd) -> list[str]:
    rows = _params(cmd)
    if not rows:
        return []
    return (["| argument / option | meaning |", "|---|---|"]
            + ["| `" + n + "` | " + h.replace("|", "\\|") + " |" for n, h in rows] + [""])


def _man_examples(path: str) -> list[str]:
    lines = [".SH EXAMPLES"] if EXAMPLES.get(path) else []
    for what, line in EXAMPLES.get(path, []):
        lines += [".PP", _roff(what), ".RS 4", ".nf", _roff("$ " + line), ".fi", ".RE"]
    return lines


def _md_examples(path: str) -> list[str]:
    items = EXAMPLES.get(path, [])
    if not items:
        return []
    return ["Examples:", "", "```sh"] + [f"# {what}\n{line}" for what, line in items] + ["```", ""]


def man_pages() -> dict[str, str]:
    cli = _cli()
    pages = {}
    date = "2026-11"
    subs = sorted(cli.commands.items())
    top = [f'.TH MUSER 1 "{date}" "muser {__version__}" "User Commands"', ".SH NAME",
           "muser \\- move a language model's KV cache honestly", ".SH SYNOPSIS",
           ".B muser\n[OPTIONS] COMMAND [ARGS]...", ".SH DESCRIPTION", _roff(cli.help or ""), ".SH COMMANDS"]
    for name, sub in subs:
        top += [".TP", f".B {name}", _roff(sub.get_short_help_str(200))]
    top += [".SH OPTIONS"]
    for names, help_ in _params(cli):
        top += [".TP", f".B {_roff(names)}", _roff(help_)]
    top += [".SH EXIT STATUS", "0 ok, 1 error, 2 usage, 65 malformed/corrupt/mismatched data, 66 missing input, "
            "75 temporary failure (fall back to local prefill), 76 remote protocol error, "
            "77 authentication/replay refused, 78 configuration.",
            ".SH ENVIRONMENT"]
    for name, what, default in ENVIRONMENT:
        top += [".TP", f".B {_roff(name)}", _roff(f"{what.replace('`', '')} Default: {default.replace('`', '')}.")]
    top += [".SH SEE ALSO", ", ".join(f"muser\\-{n}(1)" for n, _ in subs)]
    pages["man/muser.1"] = "\n".join(top) + "\n"
    for name, sub in subs:
        lines = [f'.TH MUSER\\-{name.upper()} 1 "{date}" "muser {__version__}" "User Commands"', ".SH NAME",
                 f"muser\\-{name} \\- {_roff(sub.get_short_help_str(200))}", ".SH SYNOPSIS",
                 f".B muser {name}\n{_roff(_usage(sub, name))}", ".SH DESCRIPTION", _roff(sub.help or ""), ".SH OPTIONS"]
        for names, help_ in _params(sub):
            lines += [".TP", f".B {_roff(names)}", _roff(help_)]
        for sub_name, leaf in _subcommands(sub):
            lines += [f".SS muser {name} {sub_name}", f".B muser {name} {sub_name}\n{_roff(_usage(leaf, sub_name))}",
                      ".PP", _roff((leaf.help or "").strip())]
            for names, help_ in _params(leaf):
                lines += [".TP", f".B {_roff(names)}", _roff(help_)]
        lines += _man_examples(name)
        lines += [".SH SEE ALSO", "muser(1)"]
        pages[f"man/muser-{name}.1"] = "\n".join(lines) + "\n"
    return pages


def cli_reference() -> dict[str, str]:
    cli = _cli()
    lines = ["# muser command reference", "",
             "Generated from the app by `python -m muser_cli.commands._gendocs`; do not edit by hand.", "",
             "```", "muser [OPTIONS] COMMAND [ARGS]...", "```", "", cli.help or "", ""]
    for name, sub in sorted(cli.commands.items()):
        lines += [f"## muser {name}", "", "```", f"muser {name} {_usage(sub, name)}", "```", "", (sub.help or "").strip(), ""]
        lines += _options_table(sub)
        for sub_name, leaf in _subcommands(sub):
            path = f"{name} {sub_name}"
            lines += [f"### muser {path}", "", "```", f"muser {path} {_usage(leaf, sub_name)}", "```", "",
                      (leaf.help or "").strip(), ""]
            lines += _options_table(leaf)
        lines += _md_examples(name)
    lines += ["## Exit statuses", "",
              "0 ok · 1 error · 2 usage · 65 malformed, corrupt or mismatched data · 66 missing input · "
              "75 temporary failure (peer unreachable or timed out: fall back to local prefill) · "
              "76 remote protocol error · 77 authentication or replay refused · 78 configuration", "",
              "What each status means for a script, and which command returns which: "
              "[cli-contract.md](cli-contract.md).", ""]
    lines += environment_section()
    return {"docs/cli.md": "\n".join(lines)}


# Every MUSER_* variable read anywhere in the repository: (name, what it does, default).
# stale() fails when the code reads one that is not listed here.
ENVIRONMENT = [
    ("MUSER_API_KEY", "The API key of `decode --serve` (as `--api-key`): clients send `Authorization: Bearer KEY`; "
     "needed to listen beyond loopback.", "unset: no key (loopback only)"),
    ("MUSER_HOME", "One folder for everything muser keeps, instead of the per-user platformdirs folders: "
     "`config/node` (node identity, CA, HMAC keys), `data/ledger` (replay ledgers), `data/inbox` "
     "(what `receive` publishes when it writes to stdout), `data/store` (the reuse store), `cache/spool` "
     "(send spools), `cache/models` (converted models, unless `MUSER_MODELS` is set), `cache/fingerprints`. "
     "Two nodes on one host, the tests and the demo each use their own.",
     "unset: platformdirs' user config, data and cache folders (on Linux `~/.config/muser`, "
     "`~/.local/share/muser`, `~/.cache/muser`)"),
    ("MUSER_MODELS", "Folder for models converted from GGUF (the embedded default model is converted "
     "once into it, ~20 s). Must be writable (exit 78 otherwise).", "`$MUSER_HOME/cache/models`, else the user "
     "cache folder's `models/`"),
    ("MUSER_THREADS", "Compute threads for `prefill`, `decode` and `verify --audit` when `--threads` is 0 "
     "(its default); recorded in the pack's producer field. A whole number (below 1 counts as 1); anything "
     "else is exit 78.",
     "the CPUs this process may use less those other processes keep busy at its start (watched for 50 ms), "
     "at least 1, at most 8"),
    ("MUSER_KVPACK_THREADS", "Threads the kvpack writer and reader share for payload hashing and zstd (1 = all "
     "inline, at most 64). Anything but a positive integer is ignored.", "the number of CPUs, at most 4"),
    ("MUSER_KVPACK_MINOR", "The newest kvpack minor version a producer writes: `2` lets a hybrid model past its "
     "window ship one more ring row per sliding layer (kvpack 1.2, so that a consumer's spot-check covers every "
     "layer); `1` leaves it out, for receivers of a muser that reads kvpack 1.1 only (they refuse 1.2 by "
     "version). Other packs are 1.1 either way. Anything but 1 or 2 is exit 78.", "`2`"),
    ("MUSER_STORE", "Folder of the reuse store, instead of `$MUSER_HOME/data/store` (each `batch --ray` worker "
     "sets its own).", "`data/store` under `MUSER_HOME`, else the user data folder"),
    ("MUSER_STORE_MAX", "Size cap of the reuse store (`20G`, `512M`, `1.5GiB`, bytes; powers of 1024); least "
     "recently used entries are evicted beyond it. An unreadable size is exit 2.", "`20G`"),
    ("MUSER_ROUTE", "How a consumer (`decode --producer`, `decode --serve`, `batch`) picks where a prompt's rows come from "
     "(issue #39, docs/pull-lane.md \"One latency budget\"): `fastest` predicts the TTFT of every path (store, "
     "local, remote whole, remote delta) from what this machine measured (`<data dir>/costs/`) and asks only when "
     "that is predicted faster, with the budget that beats the local path, which a producer that cannot make it "
     "answers `late` at once (so a short prompt stays local while a producer is up); `producer` asks the producer "
     "whenever one is given and the rows are not all held, without a budget. Anything else counts as `fastest`.",
     "`fastest`"),
    ("MUSER_EXPLORE", "How often the route (`MUSER_ROUTE=fastest`) takes the path predicted slower to measure it "
     "(issue #47, docs/pull-lane.md \"Corrected by measurement\"): one in N of the requests where the two paths are "
     "predicted within 1.25x (4x where the slower one was never measured at that depth), prompts of 256 rows or more; "
     "`0` never. `route.explore` says when it did.", "`8`"),
    ("MUSER_MLX_BLAS", "Which BLAS MLX's CPU matmuls use on Linux, loaded before MLX: `auto`, `mkl`, "
     "`openblas`, `reference` (the slow one bundled with `mlx[cpu]`) or a path to a library exporting "
     "`cblas_sgemm`. An explicit choice that cannot be honoured is exit 78.",
     "`auto`: MKL if found, else a system OpenBLAS, else the bundled one"),
    ("MUSER_VLLM_OPTS", "Extra options for `--engine vllm`, `KEY=VALUE,KEY=VALUE` (`prefill --vllm-opt` wins over "
     "it): `vllm.LLM`/`EngineArgs` names (`enforce_eager`, `max_model_len`, `block_size`, `attention_backend`, "
     "`kv_cache_dtype`, `gpu_memory_utilization`, ...) and muser's own `host` (vLLM's `VLLM_HOST_IP`), "
     "`kv_cache_space` (GiB) and `in_process` (vLLM's engine inside the muser process). Options that fix the "
     "canonical schedule (`max_num_batched_tokens`, `enable_chunked_prefill`, `dtype`, ...) are refused; a "
     "malformed or unknown item is exit 2.",
     "unset: muser's defaults (`enforce_eager=true`, `host=127.0.0.1`; on CPU `kv_cache_space=1`, "
     "`in_process=true`)"),
    ("MUSER_TEST_MODELS", "Tests only: folder where the test suite keeps the embedded model converted once "
     "across runs (each test still gets its own `MUSER_HOME`).", "`tests/.cache/models`"),
    ("MUSER_TEST_HANG_S", "Tests only: the ceiling, in seconds, of every wait in the suite for a process, a line "
     "or a state; it only catches a hang (tests wait for events, never for a budget a loaded machine can "
     "exceed).", "`900`"),
    ("MUSER_TEST_DEPTH", "Tests only: the prompt depth in tokens of `tests/pulllane/test_deep_lanes.py` (pull, store "
     "and delta on a tiny 132k-position model; `130815` is the seed's depth, a few minutes on two cores).", "`32768`"),
    ("MUSER_TEST_VLLM_EXTRA", "Tests only: comma-separated model families that `tests/engines/test_vllm_families.py` also "
     "moves through vLLM, beyond those the suite lists (run by hand; each starts its own vLLM).", "unset: none"),
    ("MUSER_CHECK_BUDGET_S", "`benchmarks/gpu_vllm_check.sh` only: seconds the GPU check may spend; later "
     "configurations are skipped, and said so, once it is spent.", "`900`"),
    ("MUSER_CHECK_ONLY", "`benchmarks/gpu_vllm_check.sh` only: comma-separated configuration names to run.",
     "unset: all"),
    ("MUSER_CHECK_GEMMA", "`benchmarks/gpu_vllm_check.sh` only: the Gemma 3 270M folder or GGUF its payoff runs "
     "also measure.", "unset: SmolLM2 only"),
    ("MUSER_VLLM_GDN_CPU", "`prefill --engine vllm` on vLLM's CPU build: `1` runs a gated-DeltaNet model (Qwen3-Next) "
     "that is otherwise refused (its bfloat16-only CPU kernels drift past the numeric gate; docs/vllm.md), to "
     "measure it again.", "unset: refused"),
    ("MUSER_CHECK_OUT", "`benchmarks/gpu_vllm_check.sh` only, set by the script itself for its Python part: "
     "where results go.", "the script's `$OUT`"),
    ("_MUSER_COMPLETE", "Set by the shell completion scripts in `completions/` when they ask `muser` for "
     "candidates (Typer's protocol); not for people.", "unset"),
]

_ENV_SOURCES = ("muser_cli", "commands", "tests", "benchmarks", "completions", "docs/demo.sh", "Makefile")
_ENV_SUFFIXES = (".py", ".sh", ".bash", ".fish", "")


def environment_section() -> list[str]:
    lines = ["## Environment variables", "",
             "Every `MUSER_*` variable muser, its tests or its benchmarks read. A command-line option, where "
             "there is one, wins over the variable.", "",
             "| variable | what it does | default |", "|---|---|---|"]
    for name, what, default in ENVIRONMENT:
        lines.append(f"| `{name}` | {what.replace('|', chr(92) + '|')} | {default} |")
    lines.append("")
    return lines


def environment_in_sources() -> set[str]:
    """Every ``MUSER_*`` name this repository's sources mention (this file aside)."""
    import re

    found: set[str] = set()
    # An environment name is quoted, `$`-expanded or assigned (NAME=...); a Python constant such as
    # ``MUSER_KEYS = (...)`` is none of these.
    pattern = re.compile(r"(?:(?<=[\"'`$={])_?MUSER_[A-Z0-9_]*[A-Z0-9]\b)|(?:\b_?MUSER_[A-Z0-9_]*[A-Z0-9](?==(?!=)))")
    for rel in _ENV_SOURCES:
        base = ROOT / rel
        if not base.exists():
            continue
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in _ENV_SUFFIXES)
        for f in files:
            if f.resolve() == Path(__file__).resolve() or not f.is_file() or {".cache", "__pycache__"} & set(f.parts):
                continue
            found.update(pattern.findall(f.read_text(errors="replace")))
    return found


def undocumented_environment() -> list[str]:
    """``MUSER_*`` names read in the sources but missing from :data:`ENVIRONMENT`."""
    return sorted(environment_in_sources() - {name for name, _, _ in ENVIRONMENT})


def unread_environment() -> list[str]:
    """Names :data:`ENVIRONMENT` documents that no source mentions any more."""
    return sorted({name for name, _, _ in ENVIRONMENT} - environment_in_sources())


def generated() -> dict[str, str]:
    out = {}
    out.update(completions())
    out.update(man_pages())
    out.update(cli_reference())
    return out


def stale() -> list[str]:
    bad = []
    for rel, text in generated().items():
        path = ROOT / rel
        if not path.exists() or path.read_text() != text:
            bad.append(rel)
    bad += [f"docs/cli.md (environment variable {name} is read but not in _gendocs.ENVIRONMENT)"
            for name in undocumented_environment()]
    bad += [f"docs/cli.md (environment variable {name} is documented in _gendocs.ENVIRONMENT but read nowhere)"
            for name in unread_environment()]
    for folder, keep in (("man", {k for k in generated() if k.startswith("man/")}),):
        for p in (ROOT / folder).glob("*.1"):
            if f"{folder}/{p.name}" not in keep:
                bad.append(f"{folder}/{p.name} (no longer generated)")
    return bad


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        for rel in bad:
            sys.stderr.write(f"stale: {rel}\n")
        return ExitStatus.ERROR if bad else ExitStatus.OK
    for p in (ROOT / "man").glob("*.1"):
        p.unlink()
    for rel, text in generated().items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return ExitStatus.OK


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
