"""FP8 test inputs shared by the kernel tests (tests/test_fp8_gemv.py, tests/test_fp8_quant.py)."""

from __future__ import annotations

import torch

from tokenmill.kernels.quant_weight import FP8


def grid_rows(m: int, k: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Activations whose per-token quantization is exact: e4m3 values times a power of two per row, one of them
    448 (so the row's scale is that power of two). Under the Triton interpreter, whose float -> e4m3 conversion
    is wrong between grid points, every rounding of these rows is exact."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(m, k, generator=gen) * 100).clamp(-440, 440).to(FP8).float()
    q[:, int(torch.randint(0, k, (1,), generator=gen))] = 448.0
    return (q * 2.0 ** torch.randint(-8, 3, (m, 1), generator=gen).float()).to(dtype).to(device)
