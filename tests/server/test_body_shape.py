"""check_body_shape: bounded lists refused before the body is parsed, nothing else judged."""

from __future__ import annotations

import json

import pytest

from tokenmill.engine.api import InvalidParameter, RequestBounds
from tokenmill.server.protocol import check_body_shape

BOUNDS = RequestBounds()


@pytest.mark.parametrize("field,value", [
    ("stop", ["x"] * 17), ("stop", ["x"] * 1_000_000), ("stop_token_ids", list(range(65))),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("messages", [{"role": "user", "content": "a"}] * 2049),
    ("prompt", ["p"] * 65), ("prompt", [[1, 2]] * 65),
])
def test_too_many_entries_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidParameter) as ei:
        check_body_shape(json.dumps({"model": "m", field: value}).encode(), BOUNDS)
    assert ei.value.param == field


@pytest.mark.parametrize("obj", [
    {"model": "m", "prompt": "hi", "stop": ["a"] * 16, "logit_bias": {"5": -100}, "stop_token_ids": [1] * 64},
    {"model": "m", "prompt": list(range(20000))},  # one prompt's token ids: the context bounds it later
    {"model": "m", "messages": [{"role": "user", "content": "stop" * 100}] * 10},
    {"model": "m", "tools": [{"stop": list(range(100))}], "response_format": {"stop": ["x"] * 50}},  # nested
    {"stop": "a single string"},
])
def test_bodies_within_bounds_pass(obj):
    check_body_shape(json.dumps(obj, indent=2).encode(), BOUNDS)


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b'{"stop": [1, 2', b"nonsense", b'{"stop": NaN}', b"\xff\xfe",
                                 b'{"a" 1}', b'{"stop": ["a",]}'])
def test_malformed_bodies_are_left_to_the_parser(raw):
    check_body_shape(raw, BOUNDS)
