import os

import torch

# Triton reads TRITON_INTERPRET when the kernels are decorated: set it before anything imports
# writescope.triton_attention. With CUDA present the Triton tests run compiled instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray reads this once, when it is imported: the test session's local clusters (and the heads the
# tests start as children) then bind loopback only, as writescope's entry points make them do.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _variants():
    from writescope import _cpu

    return _cpu.available_variants()


@pytest.fixture(params=_variants())
def cpu_variant(request):
    """Runs the test once per ISA variant this CPU has, restoring the default afterwards."""
    from writescope import _cpu

    default = _cpu.__cpu_variant__
    _cpu.set_variant(request.param)
    yield request.param
    _cpu.set_variant(default)


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request):
    """The device the Triton kernels run on: the CPU under the interpreter, or a CUDA GPU, compiled."""
    from writescope import env

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the compiled Triton tests need a GPU")
    if request.param == "interpreter" and not env.TRITON_INTERPRET.enabled():
        pytest.skip("TRITON_INTERPRET is off in this process: the Triton tests run compiled on CUDA")
    return "cpu" if request.param == "interpreter" else "cuda"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One real local Ray for the whole test session (token auth on, no dashboard)."""
    from writescope.actors.local_ray import start_local_ray

    os.environ.setdefault("WRITESCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))
    start_local_ray(num_cpus=8)  # logical: room for several engine groups (engine_cpus=1 each) at once
    yield
    import ray

    ray.shutdown()
