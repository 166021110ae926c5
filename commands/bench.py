"""muser bench: the lane, pack, wire and depth benchmarks, with receipts and charts (docs/benchmarking.md)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import complete_model, emit_json, guarded, info

bench_app = typer.Typer(
    help="Measure the lane, the kvpack codec and the wire: warm-up, repeated runs, median and CV, "
         "A B A B, a JSON receipt, and a chart with --plot.",
    no_args_is_help=True,
)

_REPS = "Counted repetitions after one uncounted warm-up (docs/benchmarking.md asks for 5 or more)."
_PLOT = "Draw a chart of the results into this .png (needs matplotlib: pip install 'muser[plot]')."
_RECEIPT = ("Write the JSON receipt here (a file, or a folder). Default: benchmarks/results/ in a source "
            "checkout, else the data folder's bench/.")
_JSON = "Print the receipt as one JSON object on stdout instead of the table."
_MODEL = ("Model folder, .gguf file, 'default' (the embedded model) or 'tiny' (a random 1-layer Llama "
          "with 132k positions, written once: quick runs).")

# The options lane, pack and wire share (one definition each, so their help cannot drift).
_MODEL_OPT = typer.Option("default", "--model", "-m", autocompletion=complete_model, help=_MODEL)
_DEPTHS_OPT = typer.Option("512,2048,8064", "--depths", help="Prompt depths in tokens, comma-separated.")
_REPS_OPT = typer.Option(5, "--reps", help=_REPS)
_PLOT_OPT = typer.Option(None, "--plot", help=_PLOT)
_RECEIPT_OPT = typer.Option(None, "--receipt", help=_RECEIPT)
_JSON_OPT = typer.Option(False, "--json", help=_JSON)


def _progress(line: str) -> None:
    info(f"bench: {line}")


def _report(result, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_json())
    else:
        for line in result.table:
            typer.echo(line)
    info(f"bench: receipt {result.receipt}")
    if result.plot:
        info(f"bench: chart {result.plot}")


@bench_app.command("lane")
def lane_cmd(
    model: str = _MODEL_OPT,
    depths: str = _DEPTHS_OPT,
    reps: int = _REPS_OPT,
    live: bool = typer.Option(False, "--live", help="Also run the live streamed lane: whole `prefill | send` and "
                              "`receive | decode` processes (slower: each run starts four processes)."),
    settle: float = typer.Option(8.0, "--settle", help="With --live: seconds the consumer gets to load its model "
                                 "before the producer starts."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    codec: str = typer.Option("none", "--codec", help="none | zstd+bytegroup"),
    threads: int = typer.Option(0, "--threads", help="Compute threads per side (0: 1 when pinned, else the CPUs up to 8)."),
    no_pin: bool = typer.Option(False, "--no-pin", help="Do not pin producer and consumer to two different cores."),
    plot: Optional[str] = _PLOT_OPT,
    receipt: Optional[str] = _RECEIPT_OPT,
    as_json: bool = _JSON_OPT,
) -> None:
    """Time to first token by prompt depth: local prefill against a handoff over loopback TLS.

    Producer and consumer run on two different cores when two are available (the
    receiver is a real `muser receive` process); every lane must give the same first token.
    """
    from muser_cli.bench.api import bench_lane  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        res = bench_lane(model=model, depths=depths, reps=reps, dtype=dtype, codec=codec, threads=threads,
                         pin=not no_pin, live=live, settle=settle, plot=plot, receipt=receipt, progress=_progress)
        _report(res, as_json)


@bench_app.command("pack")
def pack_cmd(
    model: str = _MODEL_OPT,
    depths: str = _DEPTHS_OPT,
    reps: int = _REPS_OPT,
    synthetic: bool = typer.Option(False, "--synthetic", help="Random bf16 rows of the model's shape instead of a "
                                   "real prefill (zstd ratios are then not real)."),
    no_peers: bool = typer.Option(False, "--no-peers", help="Leave out mlx-lm's prompt cache even when installed."),
    threads: int = typer.Option(0, "--threads", help="Threads of the one prefill that makes the KV (0: the CPUs up to 8)."),
    plot: Optional[str] = _PLOT_OPT,
    receipt: Optional[str] = _RECEIPT_OPT,
    as_json: bool = _JSON_OPT,
) -> None:
    """kvpack pack, unpack, save and load: times and bytes against mlx-lm's prompt cache and memcpy."""
    from muser_cli.bench.api import bench_pack  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        res = bench_pack(model=model, depths=depths, reps=reps, synthetic=synthetic, threads=threads,
                         peers=not no_peers, plot=plot, receipt=receipt, progress=_progress)
        _report(res, as_json)


@bench_app.command("wire")
def wire_cmd(
    sizes: str = typer.Option("1,8,64", "--sizes", help="Payload sizes in MB, comma-separated."),
    reps: int = _REPS_OPT,
    probe_seconds: float = typer.Option(1.0, "--probe-seconds", help="Seconds of each raw TLS probe."),
    no_pin: bool = typer.Option(False, "--no-pin", help="Do not pin sender and receiver to two different cores."),
    plot: Optional[str] = _PLOT_OPT,
    receipt: Optional[str] = _RECEIPT_OPT,
    as_json: bool = _JSON_OPT,
) -> None:
    """Throughput by payload size over loopback mutual TLS: kvpack send against probe-link's raw rate."""
    from muser_cli.bench.api import bench_wire  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        res = bench_wire(sizes=sizes, reps=reps, probe_seconds=probe_seconds, pin=not no_pin, plot=plot,
                         receipt=receipt, progress=_progress)
        _report(res, as_json)


@bench_app.command("depth")
def depth_cmd(
    model: str = typer.Option("tiny", "--model", "-m", autocompletion=complete_model, help=_MODEL),
    depths: str = typer.Option("8192,32768,130815", "--depths", help="Prompt depths in tokens, comma-separated."),
    reps: int = typer.Option(3, "--reps", help="Counted repetitions after one uncounted warm-up."),
    chunk: int = typer.Option(4096, "--chunk", help="Prefill chunk in tokens (the store keeps whole chunks)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    plot: Optional[str] = _PLOT_OPT,
    receipt: Optional[str] = _RECEIPT_OPT,
    as_json: bool = _JSON_OPT,
) -> None:
    """Every path to a first token by prompt depth: local, a pushed pack, the store warm, a delta
    with half held, the live pull lane; each stage's time, bytes and peak memory.

    Whole processes, producer and consumer on two different cores, one thread each; every
    path must give the local prefill's first token. Deep prompts take minutes per round.
    """
    from muser_cli.bench.api import bench_depth  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        res = bench_depth(model=model, depths=depths, reps=reps, chunk=chunk, dtype=dtype, plot=plot,
                          receipt=receipt, progress=_progress)
        _report(res, as_json)


@bench_app.command("chart")
def chart_cmd(
    receipt: str = typer.Argument(..., help="A receipt that bench lane, pack, wire or depth wrote (JSON)."),
    plot: str = typer.Option(..., "--plot", help="The .png to draw (needs matplotlib: pip install 'muser[plot]')."),
) -> None:
    """Draw the chart of an earlier receipt: the picture --plot would have drawn from it."""
    from muser_cli.bench.api import chart  # lazy: kept out of `muser --help` (startup)

    with guarded():
        info(f"bench: chart {chart(receipt, plot)}")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
