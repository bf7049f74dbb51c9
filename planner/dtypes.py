"""Training dtypes by the names users type ("bf16"), their sizes and torch types."""

from __future__ import annotations

import torch

from planner.errors import PlannerError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,  # stored as fp32; matmuls run on tf32 tensor cores
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
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
    return DTYPES[canonical_dtype(name)]


def dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize
