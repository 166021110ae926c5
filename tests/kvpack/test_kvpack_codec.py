"""Byte grouping, as docs/kvpack.md defines it: byte 0 of every element, then byte 1, ...
It gives the definition's bytes, from one buffer or from pieces (empty ones too), and
ungrouping inverts it."""

from __future__ import annotations

import numpy as np
import pytest

from muser_cli.kvpack.codec import group_bytes, group_bytes_parts, ungroup_bytes


def _defined(raw: bytes, elem: int) -> bytes:
    return b"".join(raw[b::elem] for b in range(elem))


@pytest.mark.parametrize("elem", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 4097])
def test_grouping_is_the_definition_and_ungrouping_inverts_it(elem, n):
    raw = np.random.default_rng(n * 10 + elem).integers(0, 256, n * elem, dtype=np.uint8).tobytes()
    grouped = bytes(group_bytes(raw, elem))
    assert grouped == _defined(raw, elem)
    assert bytes(ungroup_bytes(grouped, elem)) == raw
    for cuts in ([n // 3], [1, n // 2] if n > 2 else [], [0, n]):  # pieces on element boundaries
        bounds = [0, *[c * elem for c in cuts], len(raw)]
        parts = [memoryview(raw)[a:b] for a, b in zip(bounds, bounds[1:])]
        assert bytes(group_bytes_parts(parts, elem, len(raw))) == grouped
