import pytest
import torch


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
