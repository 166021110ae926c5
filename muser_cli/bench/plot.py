"""Charts of the bench receipts (``muser bench ... --plot FILE.png``), drawn with matplotlib.

matplotlib is the optional extra ``plot`` (``pip install 'muser[plot]'``), imported only
here and only when a chart is asked for. The figure is drawn on matplotlib's Agg canvas
(no pyplot, no display, no global state), rendered to bytes and written atomically: a
failed chart leaves nothing at its path.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from muser_cli.bench.wire import OVER_THE_LINK
from muser_cli.errors import ConfigError, UsageError
from muser_cli.fsio import check_output_path, write_bytes_atomic
from muser_cli.units import plural, size_text

INSTALL_HINT = "pip install 'muser[plot]'"


def require_matplotlib() -> None:
    """Refuse at once (before any measuring) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib, which is not installed ({exc})", hint=INSTALL_HINT) from None


def check_plot_path(path: str | os.PathLike) -> Path:
    """A ``.png`` path whose folder exists and is writable (checked before measuring)."""

    p = Path(path)
    check_output_path(p)
    if p.suffix.lower() != ".png":
        raise UsageError(f"--plot writes a PNG: {path} does not end in .png", hint="for example --plot ttft.png")
    require_matplotlib()
    return p


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _footer(fig, payload: dict[str, Any], note: str = "") -> None:
    m = payload.get("machine", {})
    st = payload.get("started") or {}
    load = " → ".join(f"{x['loadavg'][0]:.1f}" for x in (st, m) if x.get("loadavg"))
    bits = [f"muser {st.get('git') or m.get('git') or ''}".strip(), m.get("date", ""),
            f"{m.get('cpus_allowed', '?')} cores", f"load {load}" if load else "",
            f"median of {payload.get('reps')} reps after 1 warm-up; bars min..max"]
    import textwrap

    text = " · ".join(b for b in bits if b)
    if note:
        text = textwrap.fill("Note: " + note, 150) + "\n" + text
    fig.supxlabel(text, fontsize=7, color="0.35")


def _plain_log(axis) -> None:
    """Decade ticks as plain numbers (0.1, 1, 10, 100), no minor labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _errs(stats: list[dict[str, Any]], scale: float) -> list[list[float]]:
    return [[(s["median"] - s["min"]) * scale for s in stats], [(s["max"] - s["median"]) * scale for s in stats]]


def _write(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes_atomic(path, buf.getvalue())
    return path


def plot_lane(payload: dict[str, Any], path: Path) -> Path:
    rows = payload["rows"]
    depths = [r["depth"] for r in rows]
    deep = max(r["local"]["ttft"]["median"] for r in rows)
    unit, scale = ("s", 1.0) if deep >= 2.0 else ("ms", 1e3)
    fig, (ax, bx) = _figure(11, 4.6, 2)
    series = [("local", "local prefill (fallback)", "o-"), ("handoff", "handoff, stop-and-wait", "s-"),
              ("streamed", "live lane, streamed (processes)", "^-"),
              ("file", "live lane, stop-and-wait file (processes)", "v--")]
    for key, label, style in series:
        if key not in rows[0]:
            continue
        stats = [r[key]["ttft"] for r in rows]
        ax.errorbar(depths, [s["median"] * scale for s in stats], yerr=_errs(stats, scale), fmt=style, capsize=3,
                    label=label)
    medians = [r[k]["ttft"]["median"] for r in rows for k, _, _ in series if k in r]
    if min(medians) > 0 and max(medians) / min(medians) > 20:
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
        ax.set_ylabel(f"time to first token ({unit}, log)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.minorticks_off()
    ax.set_xlabel("prompt depth (tokens)")
    if ax.get_yscale() != "log":
        ax.set_ylabel(f"time to first token ({unit})")
    ax.set_title(f"TTFT by depth: {payload.get('model')}, {payload.get('dtype')}, "
                 f"{plural(payload.get('threads') or 0, 'thread')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    # The handoff's own cost, by part.
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part, colour in (("pack", "#4c72b0"), ("send", "#dd8452"), ("read", "#55a868")):
        vals = [r["handoff"][part]["median"] * 1e3 for r in rows]
        bx.bar(xs, vals, bottom=bottom, color=colour, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r, b in zip(xs, rows, bottom):
        frac = r["handoff"]["overhead_frac"]["median"]
        if frac is not None:
            bx.annotate(f"{frac:.1%} of prefill", (x, b), ha="center", va="bottom", fontsize=8)
    bx.set_xticks(xs, [str(d) for d in depths])
    bx.set_xlabel("prompt depth (tokens)")
    bx.set_ylabel("handoff overhead (ms)")
    bx.set_title(f"pack + send + read ({payload.get('pinning')})", fontsize=10)
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize=8)
    _footer(fig, payload)
    return _write(fig, path)


def plot_pack(payload: dict[str, Any], path: Path) -> Path:
    rows = payload["rows"]
    names = rows[0].get("cases") or list(rows[0]["seconds"])  # the receipt's JSON keys are sorted
    fig, (ax, bx) = _figure(12, max(4.6, 0.32 * len(names) * len(rows) + 1.5), 2)
    height = 0.8 / len(rows)
    for i, r in enumerate(rows):
        stats = [r["seconds"][n] for n in names]
        ys = [j + i * height for j in range(len(names))]
        ax.barh(ys, [s["median"] * 1e3 for s in stats], height=height, xerr=_errs(stats, 1e3), capsize=2,
                label=f"{r['depth']} tokens ({size_text(r['raw_kv_bytes'])} of KV)")
        for y, st in zip(ys, stats):
            ax.annotate(f" {st['median'] * 1e3:.3g} ms", (st["max"] * 1e3, y), va="center", fontsize=7)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    _plain_log(ax.xaxis)
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi * 3)  # room for the labels
    ax.set_xlabel("time (ms, log scale)")
    ax.set_title(f"{pack_title(names, payload)}: {payload.get('model')}, bf16", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    order = ["raw KV", "pack none", "pack zstd+bytegroup"]
    bnames = [n for n in order if n in rows[0]["bytes"]] + sorted(n for n in rows[0]["bytes"] if n not in order)
    biggest = max(max(r["bytes"].values()) for r in rows)
    bunit, bscale = ("MB", 1e-6) if biggest >= 1e6 else ("kB", 1e-3)
    for i, r in enumerate(rows):
        ys = [j + i * height for j in range(len(bnames))]
        bars = [r["bytes"][n] * bscale for n in bnames]
        bx.barh(ys, bars, height=height, label=f"{r['depth']} tokens")
        for y, b in zip(ys, bars):
            bx.annotate(f" {b:.4g}", (b, y), va="center", fontsize=7)
    bx.set_yticks([j + 0.4 - height / 2 for j in range(len(bnames))], bnames, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(0, biggest * bscale * 1.15)  # room for the labels
    bx.set_xlabel(f"size ({bunit})")
    synthetic = str(payload.get("kv", "")).startswith("synthetic")
    bx.set_title("size" + (" (synthetic KV: zstd's ratio is not a real one)" if synthetic else ""), fontsize=10)
    bx.grid(True, axis="x", alpha=0.3)
    bx.legend(fontsize=8)
    _footer(fig, payload)
    return _write(fig, path)


def pack_title(cases: list[str], payload: dict[str, Any]) -> str:
    """"kvpack vs mlx-lm and memcpy", naming only the systems the chart has rows of."""
    peers = [name for name in ("mlx-lm", "memcpy") if any(name in case for case in cases)]
    title = "kvpack vs " + " and ".join(peers) if peers else "kvpack"
    if "mlx-lm" not in peers and not payload.get("mlx_lm", True):
        title += " (mlx-lm not measured: not installed, or --no-peers)"
    return title


def plot_wire(payload: dict[str, Any], path: Path) -> Path:
    rows = payload["rows"]
    sizes = [r["bytes"] / 1e6 for r in rows]
    fig, (ax,) = _figure(8, 4.8)
    for key, label, style in (("probe_up_Bps", "raw TLS (probe-link, up)", "o--"),
                              ("payload_rate_Bps", "kvpack send, timed at the sender (socket writes)", "s-"),
                              ("end_to_end_Bps", "kvpack send, end to end (connect to the receiver's Ack)", "^-")):
        stats = [r[key] for r in rows]
        ax.errorbar(sizes, [s["median"] / 1e6 for s in stats], yerr=_errs(stats, 1e-6), fmt=style, capsize=3,
                    label=label)
    ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{r.get('megabytes', x):g}" for r, x in zip(rows, sizes)])
    ax.minorticks_off()
    ax.set_xlabel("payload (MB, log scale)")
    ax.set_ylabel("throughput (MB/s)")
    ax.set_title(f"throughput by payload size: {payload.get('link', 'loopback TLS')}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    over = any(r["payload_rate_Bps"]["median"] > r["probe_up_Bps"]["median"] for r in rows)
    _footer(fig, payload, OVER_THE_LINK if over else "")
    return _write(fig, path)


def plot_depth(payload: dict[str, Any], path: Path) -> Path:
    """TTFT by depth per path (log-log), and each push stage's peak RSS against the pack's size."""
    rows = payload["rows"]
    depths = [r["depth"] for r in rows]
    fig, (ax, bx) = _figure(11, 4.6, 2)
    series = [("local", "ttft", "local prefill (fallback)", "o-"), ("push", "ttft", "ready pack (pushed, verified)", "s-"),
              ("store", "ttft", "store, warm", "D-"), ("delta", "ttft", "delta, half held", "v-"),
              ("local", "first_token_s", "local, whole process (start, load)", "o--"),
              ("pull", "ttft", "live pull lane, whole process", "^--")]
    for key, figure, label, style in series:
        stats = [r[key][figure] for r in rows]
        ax.errorbar(depths, [max(s["median"], 1e-4) for s in stats], yerr=_errs(stats, 1.0), fmt=style, capsize=3,
                    label=label)
    for axis in (ax.xaxis, ax.yaxis):
        _plain_log(axis)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(depths, [f"{d:,}" for d in depths])
    ax.minorticks_off()
    ax.set_xlabel("prompt depth (tokens)")
    ax.set_ylabel("time to first token (s, log; solid: model loaded)")
    ax.set_title(f"TTFT by depth and path: {payload.get('model')}, {payload.get('dtype')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    packs = [r["push"]["pack_bytes"] / 1e6 for r in rows]
    for stage, style in (("prefill", "o-"), ("send", "s--"), ("receive", "^--"), ("verify", "v--"),
                         ("decode", "D-")):
        bx.plot(packs, [r["push"]["rss"][stage]["median"] / 1e6 for r in rows], style, label=stage)
    bx.set_xlabel("kvpack (MB)")
    bx.set_ylabel("peak RSS of the process (MB)")
    bx.set_title(f"memory by stage ({payload.get('pinning')})", fontsize=10)
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=8)
    _footer(fig, payload)
    return _write(fig, path)


PLOTTERS = {"lane": plot_lane, "pack": plot_pack, "wire": plot_wire, "depth": plot_depth}


def plot(name: str, payload: dict[str, Any], path: str | os.PathLike) -> Path:
    require_matplotlib()
    return PLOTTERS[name](payload, Path(path))
