"""Shared test helpers: device parametrization and per-dtype tolerances."""
import pytest
import torch

import attnres  # noqa: F401  (loads the ops)

CUDA_SKIP_REASON = "no CUDA device visible (CUDA kernels are compiled but cannot run here)"

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)
    ),
]

# Relative error ||out - ref|| / ||ref|| allowed against the float64 reference.
REL_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


# Gradients: the key path has an inherent cancellation (u - k (u.k)/D) that
# costs a few more bits than the forward in reduced precision.
GRAD_REL_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
