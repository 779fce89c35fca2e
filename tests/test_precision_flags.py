"""A precision flag the user set does what it says, or the command refuses it."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from tokenmill.cli import app, resolve_precision


@pytest.mark.parametrize("dtype,quant,want", [
    (None, None, ("bfloat16", "auto")),  # the file's own blocks (tests/model/test_loader.py)
    ("float32", None, ("float32", "none")),  # the exact mode, not int4 with bf16 compute
    ("float32", "none", ("float32", "none")),
    ("bfloat16", None, ("bfloat16", "auto")),
    (None, "none", ("bfloat16", "none")),
    (None, "int8", ("bfloat16", "int8")),
])
def test_resolved_precision(dtype, quant, want):
    assert resolve_precision(dtype, quant) == want


@pytest.mark.parametrize("dtype,quant", [("float32", "int4"), ("float32", "int8"), ("float32", "auto"), ("float16", None),
                                        (None, "q4")])
def test_contradictions_and_unknown_values_are_refused(dtype, quant):
    with pytest.raises(typer.Exit) as ei:
        resolve_precision(dtype, quant)
    assert ei.value.exit_code == 2


def test_serve_refuses_float32_with_int4_before_loading_anything():
    result = CliRunner().invoke(app, ["serve", "--dtype", "float32", "--quantization", "int4", "--port", "1"])
    assert result.exit_code == 2
    assert "cannot run with --dtype float32" in result.output
