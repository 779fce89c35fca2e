"""Shared fixtures: the embedded model and its transformers reference, loaded once."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


def pytest_addoption(parser):
    parser.addoption("--real-model", action="store_true",
                     help="also run the tests marked real_model (installed models such as qwen2.5-coder-0.5b; "
                          "not CI: make test-real)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--real-model"):
        return
    skip = pytest.mark.skip(reason="needs --real-model (make test-real)")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from tokenmill.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol(embedded_path):
    from tokenmill.model.loader import load_model

    return load_model(embedded_path, "float32")


@pytest.fixture(scope="session")
def hf_smol(embedded_path):
    transformers = pytest.importorskip("transformers")
    d, f = os.path.split(embedded_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(embedded_path):
    transformers = pytest.importorskip("transformers")
    d, f = os.path.split(embedded_path)
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def smol_int4(embedded_path):
    """The embedded model in the default configuration (bfloat16, int4 matmuls)."""
    from tokenmill.model.loader import load_model

    return load_model(embedded_path, "bfloat16", "int4")


@pytest.fixture(scope="session")
def smol_int8(embedded_path):
    """The embedded model with int8 matmuls (Q8_0 blocks where the VNNI kernels run)."""
    from tokenmill.model.loader import load_model

    return load_model(embedded_path, "bfloat16", "int8")
