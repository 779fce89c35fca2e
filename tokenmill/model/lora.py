"""LoRA adapters: read from PEFT folders and llama.cpp LoRA GGUFs, and applied per row
beside the base model's matmuls (never merged into the base weights: requests on
different adapters and on the base share one batch).

An adapter changes a linear layer to y = W x + scale * B (A x), A [r, in] and B [out, r].
The model fuses q/k/v and gate/up into one matmul each, so an adapter's update of a
fused matmul stacks the A of each part it targets, and each output column takes its own
part's B row against its part's block of A x (`Packed`). The update runs in the native
kernels row by row (csrc/lora.cpp), the same code in the separate ops and inside the
fused decode step: a row's numbers do not depend on what it is batched with.

Adapters occupy slots (`AdapterSlots`, `--max-loras`): a step's rows carry their slot
(-1 for the base model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.model.config import ModelConfig

# the projections an adapter may target, by the name transformers gives them
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llama.cpp's tensor names for them
GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# each of the model's four matmuls a layer and the parts it fuses
FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
MAX_ADAPTER_BYTES = 2 * 1024 ** 3


class AdapterError(ValueError):
    """An adapter that cannot be loaded: what is wrong with it, for the user."""

    param = "lora_path"  # the request parameter at fault, for the API's error


@dataclass
class Adapter:
    """One adapter's weights (float32, the scale kept apart), keyed (layer, module); once
    placed in a slot the kernels' copy is the one kept and `weights` is emptied."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # A [r, in], B [out, r]
    digest: str  # of the files' bytes: the prefix cache keys blocks by it
    modules: tuple[str, ...] = ()  # the projections it targets
    nbytes: int = 0  # of its float32 A and B
    load_seconds: float = 0.0


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target."""
    H, Hkv, d, hid, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (H * d, hid), "k_proj": (Hkv * d, hid), "v_proj": (Hkv * d, hid), "o_proj": (hid, H * d),
            "gate_proj": (inter, hid), "up_proj": (inter, hid), "down_proj": (hid, inter)}


def _digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> Adapter:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp LoRA
    GGUF, checked against the base model `cfg` (every tensor's shape, the rank, finite
    values): raises AdapterError saying what is wrong."""
    t0 = time.monotonic()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise AdapterError(f"adapter {name!r}: {path} does not exist")
    if os.path.isdir(path):
        rank, scale, weights, files = _read_peft(path)
    elif path.endswith(".gguf"):
        rank, scale, weights, files = _read_gguf(path, cfg)
    else:
        raise AdapterError(f"adapter {name!r}: expected a PEFT folder or a .gguf file, got {path}")
    if not weights:
        raise AdapterError(f"adapter {name!r}: no LoRA weights for {', '.join(MODULES)} in {path}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    shapes = module_shapes(cfg)
    for (layer, module), (a, b) in weights.items():
        where = f"adapter {name!r}: layer {layer} {module}"
        if not 0 <= layer < cfg.num_layers:
            raise AdapterError(f"{where}: the base model has {cfg.num_layers} layers")
        out, inp = shapes[module]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise AdapterError(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base model "
                               f"(A [{rank}, {inp}], B [{out}, {rank}])")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: weights are not finite")
    adapter = Adapter(name, path, rank, scale, weights, _digest(files),
                      tuple(sorted({m for _, m in weights}, key=MODULES.index)),
                      sum(a.nbytes + b.nbytes for a, b in weights.values()))
    if adapter.nbytes > MAX_ADAPTER_BYTES:
        raise AdapterError(f"adapter {name!r}: {adapter.nbytes / 2 ** 20:.0f} MiB is over the limit")
    adapter.load_seconds = time.monotonic() - t0
    return adapter


_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def _read_peft(path: str):
    from safetensors import safe_open

    cfg_path = os.path.join(path, "adapter_config.json")
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(cfg_path) or not os.path.exists(st_path):
        raise AdapterError(f"{path}: a PEFT adapter folder holds adapter_config.json and adapter_model.safetensors")
    try:
        with open(cfg_path) as f:
            conf = json.load(f)
        rank, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"{cfg_path}: not a LoRA adapter config ({exc})") from None
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {conf.get('peft_type')!r} is not LORA")
    for unsupported in ("fan_in_fan_out", "use_dora"):
        if conf.get(unsupported):
            raise AdapterError(f"{cfg_path}: {unsupported} adapters are not supported")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise AdapterError(f"{cfg_path}: per-module ranks (rank_pattern, alpha_pattern) are not supported")
    if rank < 1:
        raise AdapterError(f"{cfg_path}: rank must be positive, got {rank}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(st_path, framework="pt") as f:
            for key in f.keys():
                m = _PEFT_KEY.search(key)
                if m is None:
                    if "lora_" in key or "modules_to_save" in key:
                        raise AdapterError(f"{st_path}: tensor {key!r} is not a LoRA update of {', '.join(MODULES)}")
                    continue
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if module not in MODULES:
                    raise AdapterError(f"{st_path}: {module} is not one of {', '.join(MODULES)}")
                parts.setdefault((layer, module), {})[ab] = f.get_tensor(key).float()
    except AdapterError:
        raise
    except Exception as exc:  # a corrupt or truncated file
        raise AdapterError(f"{st_path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    weights = {}
    for key, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{st_path}: layer {key[0]} {key[1]} lacks lora_{'B' if 'A' in ab else 'A'}")
        weights[key] = (ab["A"].contiguous(), ab["B"].contiguous())
    return rank, scale, weights, [cfg_path, st_path]


_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def _read_gguf(path: str, cfg: ModelConfig):
    from tokenmill.model.gguf_loader import GGUFFile, ModelLoadError, _reverse_permute

    try:
        g = GGUFFile(path)
    except ModelLoadError as exc:
        raise AdapterError(str(exc)) from None
    meta = g.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a llama.cpp LoRA adapter (general.type {meta.get('general.type')!r}, "
                           f"adapter.type {meta.get('adapter.type')!r})")
    arch = meta.get("general.architecture")
    if arch is not None and arch != cfg.architecture:
        raise AdapterError(f"{path}: an adapter for {arch}, the base model is {cfg.architecture}")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name in g.tensors:
        m = _GGUF_KEY.match(name)
        if m is None or m.group(2) not in GGUF_MODULES:
            raise AdapterError(f"{path}: tensor {name!r} is not a LoRA update of {', '.join(GGUF_MODULES)}")
        layer, module, ab = int(m.group(1)), GGUF_MODULES[m.group(2)], m.group(3).upper()
        try:
            w = g.dequantize(name)
        except Exception as exc:
            raise AdapterError(f"{path}: tensor {name!r} cannot be read ({exc})") from None
        # llama.cpp interleaves the Q/K rows of llama-arch files; B's rows are the outputs
        if ab == "B" and cfg.architecture in ("llama", "mistral") and module in ("q_proj", "k_proj"):
            w = _reverse_permute(w, cfg.num_heads if module == "q_proj" else cfg.num_kv_heads)
        parts.setdefault((layer, module), {})[ab] = torch.from_numpy(np.array(w, dtype=np.float32))
    weights, ranks = {}, set()
    for key, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {key[0]} {key[1]} lacks lora_{'b' if 'A' in ab else 'a'}")
        weights[key] = (ab["A"], ab["B"])
        ranks.add(ab["A"].shape[0])
    if len(ranks) > 1:
        raise AdapterError(f"{path}: per-module ranks {sorted(ranks)} are not supported")
    rank = ranks.pop() if ranks else 0
    alpha = float(meta.get("adapter.lora.alpha", rank) or rank)
    return rank, (alpha / rank if rank else 1.0), weights, [path]


@dataclass
class Packed:
    """One adapter's updates of the model's 4 matmuls a layer, for the native table:
    A [R, in] (the targeted parts' A stacked), B [out, r] (each column's row of its part's
    B, times the scale) and seg [out] int32 (where the column's part starts in A x; -1:
    not targeted); empty tensors where the adapter targets none of a matmul's parts."""

    As: list[torch.Tensor] = field(default_factory=list)
    Bs: list[torch.Tensor] = field(default_factory=list)
    segs: list[torch.Tensor] = field(default_factory=list)


_EMPTY_F = torch.empty(0, dtype=torch.float32)
_EMPTY_I = torch.empty(0, dtype=torch.int32)


def pack(adapter: Adapter, cfg: ModelConfig) -> Packed:
    shapes = module_shapes(cfg)
    r = adapter.rank
    out = Packed()
    for layer in range(cfg.num_layers):
        for parts in FUSED:
            n = sum(shapes[p][0] for p in parts)
            targeted = [(p, adapter.weights.get((layer, p))) for p in parts]
            if all(w is None for _, w in targeted):
                out.As.append(_EMPTY_F)
                out.Bs.append(_EMPTY_F)
                out.segs.append(_EMPTY_I)
                continue
            As, B, seg = [], torch.zeros(n, r), torch.full((n,), -1, dtype=torch.int32)
            col = 0
            for p, w in targeted:
                rows = shapes[p][0]
                if w is not None:
                    seg[col:col + rows] = len(As) * r
                    B[col:col + rows] = w[1] * adapter.scale
                    As.append(w[0])
                col += rows
            out.As.append(torch.cat(As).contiguous())
            out.Bs.append(B.contiguous())
            out.segs.append(seg)
    return out


class AdapterSlots:
    """The model's resident adapters: `slots` places, each an Adapter or None, and the
    table the native kernels read (None without them: a torch fallback per row)."""

    def __init__(self, cfg: ModelConfig, slots: int, ops=None, dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.ops = ops
        self.adapters: list[Adapter | None] = [None] * slots
        # a bfloat16 model's adapters in bfloat16 too: half the bytes each step reads per adapter
        self.table = (ops.LoraTable(slots, 4 * cfg.num_layers, dtype == torch.bfloat16) if ops is not None
                      else None)
        self._packed: list[Packed | None] = [None] * slots

    def slot_of(self, name: str) -> int | None:
        for i, a in enumerate(self.adapters):
            if a is not None and a.name == name:
                return i
        return None

    def put(self, slot: int, adapter: Adapter) -> None:
        packed = pack(adapter, self.cfg)
        if self.table is not None:  # (the table keeps its own copy, transposed)
            self.table.set(slot, packed.As, packed.Bs, packed.segs)
        else:
            self._packed[slot] = packed
        self.adapters[slot] = dataclasses.replace(adapter, weights={})

    def clear(self, slot: int) -> None:
        if self.table is not None:
            self.table.clear(slot)
        self.adapters[slot] = None
        self._packed[slot] = None

    def apply_(self, m: int, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """y [T, out] plus each row's adapter update of matmul m (4 a layer) from x [T, in]
        (in place where it can)."""
        if self.table is not None:
            y = y.contiguous()
            self.ops.lora_apply_(self.table, m, x, y, slots)
            return y
        for s in torch.unique(slots).tolist():  # (no native build: torch, per slot)
            p = self._packed[s] if s >= 0 else None
            if p is None or p.As[m].numel() == 0:
                continue
            rows = (slots == s).nonzero().squeeze(1)
            xa = x.index_select(0, rows).float() @ p.As[m].T
            seg = p.segs[m].long()
            cols = (seg >= 0).nonzero().squeeze(1)
            idx = seg[cols].unsqueeze(1) + torch.arange(p.Bs[m].shape[1])  # [cols, r] into xa
            delta = (xa[:, idx] * p.Bs[m][cols]).sum(-1)  # [rows, cols]
            y[rows.unsqueeze(1), cols] = (y[rows.unsqueeze(1), cols].float() + delta).to(y.dtype)
        return y
