"""Kernel tests run compiled on a GPU, or through Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be in the environment before ``triton.jit`` decorates the
kernels; kvxfer_client.kernels imports its triton module lazily, so setting it here,
at conftest import, is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (kv device, slot placement, staging bytes). Host slots are the host-pool path:
# pinned with the default staging (copy engine), pinned direct (kernel writes host
# memory), and small staging buffers that force many chunks, pinned and pageable.
PLACEMENTS: list[tuple[str, str, int | None]] = (
    [
        ("cuda", "cuda", None),
        ("cuda", "pinned", None),
        ("cuda", "pinned", 0),
        ("cuda", "pinned", 8192),
        ("cuda", "pageable", 8192),
    ]
    if torch.cuda.is_available()
    else [("cpu", "cpu", None)]
)


@pytest.fixture(params=PLACEMENTS, ids=lambda p: f"{p[0]}-{p[1]}" + ("" if p[2] is None else f"-staging{p[2]}"))
def placement(request: pytest.FixtureRequest) -> tuple[str, str, int | None]:
    value: tuple[str, str, int | None] = request.param
    return value
