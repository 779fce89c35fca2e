"""A GGUF header reader: metadata and tensor locations, tensors as views of one memory map.

gguf-py's GGUFReader builds a numpy memmap view for every part of every field, which
for a tokenizer of 49,152 strings took seconds of a cold start (most of the time before
the first token). This parser reads the same header with `struct` and numpy in tens of
milliseconds and returns the same values (tests compare it with gguf-py's).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: int
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray  # float32/float16 elements, or [rows, bytes per row] uint8 blocks


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"the header ends early (wanted {n} bytes at offset {self.pos})")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return str(self.take(n), "utf-8")

    def _strings(self, count: int) -> list[str]:
        # a tokenizer's vocabulary: tens of thousands, so one tight loop
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack_from = struct.unpack_from
        out = []
        for _ in range(count):
            (n,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError("a string runs past the end of the file")
            out.append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                raw = self.take(count * dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).tolist()
            if etype == _STRING:
                return self._strings(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")


class GGUFReader:
    """`metadata` (key -> Python value) and `tensors` (in file order) of a GGUF file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.mm))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
            infos.append((name, shape, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(name, shape, ttype, start + off) for name, shape, ttype, off in infos]

    def _tensor(self, name: str, shape: tuple[int, ...], ttype: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name!r} has an unknown type {ttype}") from None
        n = int(np.prod(shape)) if shape else 1
        n_bytes = n // block * type_size
        end = min(offset + n_bytes, len(self.mm))
        raw = self.mm[offset:end]
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16)
        else:  # blocks: one row of bytes per row of the tensor
            row_bytes = shape[0] // block * type_size if shape else n_bytes
            data = raw.reshape(-1, row_bytes) if row_bytes and len(raw) % row_bytes == 0 else raw
        return TensorInfo(name, shape, ttype, offset, n_bytes, data)
