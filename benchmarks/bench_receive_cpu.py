"""The receiver at wire speed (issue 14, part 3): the receiving process's own CPU seconds
per byte, a handoff against raw TLS (the measuring is muser_cli/bench/receive_cpu.py).

    python benchmarks/bench_receive_cpu.py [--mb 64] [--reps 5] [--probe-seconds 1] [--spool DIR]

``cpu_ratio`` = (probe CPU s per byte) / (handoff CPU s per byte): the share of the raw TLS
rate a receiver whose core is the bottleneck keeps while it verifies and stores (aim >=
0.9). The wall-clock rates are kept too, but on a shared, loaded machine only the CPU
figure is steady. Receipt: benchmarks/results/receive-cpu-*.json.
"""

from __future__ import annotations

from _common import bench_args, write_receipt


def notes(ap) -> None:
    ap.add_argument("--spool", default="", help="the receiver's output folder (default: a temporary folder on disk)")
    ap.add_argument("--label", default="", help="a note for the receipt (e.g. which tree)")


def main() -> int:
    args = bench_args(notes, mb=64.0, reps=5, probe_seconds=1.0)
    from muser_cli.bench.receive_cpu import run_receive_cpu

    out = run_receive_cpu(args.mb, reps=args.reps, probe_seconds=args.probe_seconds, spool=args.spool or None,
                          progress=lambda line: print(line, flush=True))
    path = write_receipt("receive-cpu", {"label": args.label, **out,
                                         "note": "CPU seconds per byte of the receiving process"})
    r, w = out["figures"]["cpu_ratio"], out["figures"]["wall_ratio"]
    print(f"cpu_ratio median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}, cv {r['cv']:.1%}); "
          f"wall ratio median {w['median']:.3f}; load {out['loadavg_before'][0]:.1f} -> {out['loadavg_after'][0]:.1f}")
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
