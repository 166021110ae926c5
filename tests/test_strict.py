"""The strict-input toolkit every reader of untrusted bytes uses (muser_cli/strict.py)."""

from __future__ import annotations

import pytest

from muser_cli.errors import DataError, ProtocolError, UsageError
from muser_cli.strict import canonical_json, loads, parse_rate, parse_size


def test_canonical_json_is_sorted_compact_ascii():
    assert canonical_json({"b": 1, "a": [1, "é"]}) == b'{"a":[1,"\\u00e9"],"b":1}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


@pytest.mark.parametrize("data, says", [
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"a": NaN}', "NaN is not allowed"),
    (b'{"a": Infinity}', "Infinity is not allowed"),
    (b'\xff{"a": 1}', "not UTF-8"),
    (b'[' * 100 + b']' * 100, "nested deeper than 64"),
    (b'{"a": ', "not valid JSON"),
    (b'{"a": "' + b"x" * 2000 + b'"}', "over the 1024-byte limit"),
])
def test_loads_refuses_with_one_line_of_the_callers_class(data, says):
    for error in (DataError, ProtocolError):
        with pytest.raises(error, match=says) as info:
            loads(data, "the thing", limit=1024, error=error)
        assert "\n" not in str(info.value) and "the thing" in str(info.value)


def test_loads_reads_what_is_fine():
    assert loads('{"a": [1, 2, {"b": null}]}', "x", limit=100) == {"a": [1, 2, {"b": None}]}
    assert loads(b'"[[[{"', "x", limit=100) == "[[[{"  # brackets inside strings do not nest


@pytest.mark.parametrize("text, value", [
    ("1048576", 1 << 20), ("512K", 512 << 10), ("64M", 64 << 20), ("2G", 2 << 30), ("1T", 1 << 40),
    ("1.5GiB", 3 << 29), ("20GB", 20 << 30), (" 8m ", 8 << 20), (4096, 4096),
])
def test_parse_size_one_grammar(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "1X", "G", "1..5G", "one"])
def test_parse_size_refuses_as_usage(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_parse_rate_bytes_and_bits():
    assert parse_rate("100M") == 100e6 and parse_rate("20MB/s") == 20e6
    assert parse_rate("800Mbit") == 100e6 and parse_rate("100Mbps") == 12.5e6
    for bad in ("0", "fast", "-5M"):
        with pytest.raises(UsageError):
            parse_rate(bad)
