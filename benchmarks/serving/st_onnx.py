"""sentence-transformers' pipeline with the transformer run by ONNX Runtime: the peer's
fastest CPU format, for benchmarks/serving/embeddings.py.

sentence-transformers' own `backend="onnx"` needs optimum-onnx, whose only release
(0.1.0) pins transformers < 4.58 and fails to import beside the transformers 5 this
project uses. So the same steps are taken by hand: the folder's BertModel exported
once with torch.onnx (opset 17), run by an onnxruntime session (all graph
optimizations, 2 intra-op threads), between sentence-transformers' own tokenizer and
its mean pooling and normalization. ONNX Runtime's BERT fusion (onnxruntime.transformers
optimizer: fused attention, skip layer norms, bias GELU) was slower here (b32: 293-302
ms against 286-289 plain), so the plain graph is the one measured.

The packages live outside the project's environment, in .peers/st-onnx (git-ignored),
as llama-server lives in .peers/llama-server:

    .venv/bin/python -m benchmarks.serving.st_onnx --install
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks.servers import ROOT

SITE = ROOT / ".peers" / "st-onnx"
PACKAGES = ("onnxruntime==1.31.1", "onnx==1.23.2", "ml_dtypes==0.7.0")  # (their other needs are in .venv)


def available() -> bool:
    return (SITE / "onnxruntime").is_dir() and (SITE / "onnx").is_dir()


def install() -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(SITE), *PACKAGES],
                   check=True)


def export(folder: str, out: Path) -> Path:
    """The folder's BertModel as ONNX (last hidden state; batch and length dynamic)."""
    import torch
    from transformers import AutoModel

    path = out / "model.onnx"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.ones(2, 16, dtype=torch.long)
    torch.onnx.export(Hidden(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
                      input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={k: {0: "batch", 1: "length"} for k in names + ["last_hidden_state"]},
                      opset_version=17, dynamo=False)
    return path


def encoder(st, folder: str, work: Path, threads: int):
    """encode(texts) -> unit vectors [n, hidden], as st.encode gives them."""
    if str(SITE) not in sys.path:
        sys.path.append(str(SITE))
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(export(folder, work)), opts, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}

    def encode(texts: list[str]):
        feats = st.preprocess(texts)
        states = sess.run(None, {k: v.numpy() for k, v in feats.items() if k in wanted})[0]
        mask = feats["attention_mask"].numpy()[..., None].astype(np.float32)
        pooled = (states * mask).sum(1) / mask.sum(1)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return encode


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help=f"pip install {' '.join(PACKAGES)} into {SITE}")
    if ap.parse_args().install:
        install()
    print("ready" if available() else f"not installed in {SITE}")
