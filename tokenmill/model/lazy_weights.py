"""A checkpoint's tensors made one at a time, when asked, and never kept.

Preparing a quantized model dequantizes each weight to float32 before requantizing it.
Made all at once, those floats are four bytes a parameter (Qwen2.5-Coder-1.5B: 7.1 GB at
once, a 12.8 GB peak with the rest); made as each layer is built and dropped once it is
quantized, the float copy alive at any moment is one layer's matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


class LazyWeights(Mapping):
    """name -> tensor; each lookup makes the tensor afresh (ask once, keep what you need)."""

    def __init__(self, makers: dict[str, Callable[[], Any]], shapes: dict[str, tuple[int, ...]]):
        self._makers = dict(makers)
        self._shapes = dict(shapes)

    def __getitem__(self, name: str) -> Any:
        return self._makers[name]()

    def __contains__(self, name: object) -> bool:  # (Mapping's own would make the tensor)
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape without making it."""
        return self._shapes[name]

    def pop(self, name: str, default: Any = None) -> Any:
        """Forget a name (its tensor is not made)."""
        self._shapes.pop(name, None)
        return self._makers.pop(name, default)


def shape_of(weights: Mapping, name: str) -> tuple[int, ...]:
    """A weight's shape, made lazily or not."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
