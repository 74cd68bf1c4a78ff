"""Test helpers for tensors: a shape- and dtype-checked allclose and seeded generators."""

from __future__ import annotations

import numpy as np
import torch


def assert_close(actual, expected, rtol: float = 1e-12, atol: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Shape- and dtype-checked allclose (numpy's: torch.testing's first call costs seconds of lazy imports)."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=rtol, atol=atol)


def gen(seed: int) -> torch.Generator:
    """A CPU torch generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)
