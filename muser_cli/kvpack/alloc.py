"""Destination arrays for a pack's rows, carved out of one allocation.

A reader assembles each layer's rows into arrays of its own. Allocated one by one (a few
MB each), every array is a fresh mapping whose pages fault in one 4 KiB page at a time
as the rows are copied in -- on the machine measured (docs/benchmarks.md, session 6)
that cost four times the copy itself. One slab for the whole pack is one mapping, large
enough for numpy to ask the kernel for transparent huge pages, so the same copy faults
in 2 MiB at a time. The arrays handed out are views of the slab (which lives as long as
any of them does); each starts on a 64-byte boundary, and each is the ``base`` of the
views taken of it.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

ALIGN_BYTES = 64


def slab_arrays(shapes: Sequence[tuple[int, ...]], dtype: np.dtype | str) -> list[np.ndarray]:
    """Empty, writable, C-contiguous arrays of ``shapes``, all views of one allocation."""
    dt = np.dtype(dtype)
    step = max(1, ALIGN_BYTES // dt.itemsize)
    counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    offsets, total = [], 0
    for n in counts:
        offsets.append(total)
        total += -(-n // step) * step  # round each up so the next starts aligned
    # over-allocate one alignment step so the first array can start on a boundary
    raw = np.empty(total * dt.itemsize + ALIGN_BYTES, dtype=np.uint8)
    mem = memoryview(raw)[(-raw.ctypes.data) % ALIGN_BYTES :]
    # Each array is made on a buffer object of its own (a ctypes view of its slice of the
    # slab): its ``base`` is then that object, not the slab, so a view of its leading rows
    # has the whole array as ``base`` -- as with an array allocated alone (the torch
    # engine's adopting install looks there for the room after the rows).
    out = []
    for o, n, shape in zip(offsets, counts, shapes):
        piece = mem[o * dt.itemsize : (o + n) * dt.itemsize]
        holder = (ctypes.c_char * len(piece)).from_buffer(piece) if len(piece) else bytearray()
        out.append(np.ndarray(shape, dtype=dt, buffer=holder))
    return out
