"""``muser bench``: the lane, pack and wire benchmarks as a command, with receipts (docs/benchmarking.md)."""
