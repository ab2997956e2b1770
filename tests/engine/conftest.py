"""What the engine tests share."""

import os

import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The engine's device: the CPU here; on a CUDA machine the same tests run with the device's side
    on the GPU (window, ping-pong, DeepSeek-V4's sliding windows and indexer), pinned cpu_transfer
    and Triton device partials."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: Triton runs interpreted on CPU tensors only")
    return request.param
