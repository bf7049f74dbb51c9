"""Training dtypes by the names users type ("bf16"), their sizes and torch types.

Torch is imported only by `torch_dtype`: planning needs names and sizes alone, and
importing torch takes about a second of a solve whose trace is cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import PlannerError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Dtype:
    """How a training dtype is stored: bytes per element and the torch dtype's name."""

    itemsize: int
    torch_name: str


DTYPES: dict[str, Dtype] = {
    "fp32": Dtype(4, "float32"),
    "tf32": Dtype(4, "float32"),  # stored as fp32; matmuls run on tf32 tensor cores
    "bf16": Dtype(2, "bfloat16"),
    "fp16": Dtype(2, "float16"),
}
ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "half": "fp16"}


def canonical_dtype(name: str) -> str:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise PlannerError("bad-value", f"Unknown dtype {name!r}; use one of "
                           f"{', '.join(DTYPES)}.",
                           ["bf16 where every device has fast bf16, else fp16"])
    return key


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[canonical_dtype(name)].torch_name)


def dtype_bytes(name: str) -> int:
    return DTYPES[canonical_dtype(name)].itemsize
