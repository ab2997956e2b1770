"""The kernels' thread pool, whose idle workers poll for pool_spin() microseconds before they sleep:
a job posted while they poll and one posted after they sleep give the serial result bit for bit, an
idle pool sleeps (no CPU burnt), a pool rebuilt while its workers poll does not hang, and callers on
several Python threads each get their own result. Each case runs in a child process with a time
limit, so a lost wake-up fails the test instead of hanging the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from writescope import _cpu

CHILD_TIMEOUT_S = 120
REPO_ROOT = Path(__file__).resolve().parents[2]

# Shared by every child: a job large enough for the pool's workers (the launcher runs jobs under
# 256 KiB of KV on the caller alone): 4 kv heads x 613 tokens of bf16 K and V, 1.2 MiB.
PRELUDE = """
import threading, time
import torch
from writescope import _cpu, ops
from tests.inputs import make_inputs

SPIN_S = _cpu.pool_spin() * 1e-6
torch.manual_seed(0)
inputs = [make_inputs(seq_len=613, head_dim=128, group=4, num_kv_heads=4, dtype=torch.bfloat16) for _ in range(3)]
_cpu.set_num_threads(1)
serial = [ops.partial_attention(*x, backend="cpu") for x in inputs]
_cpu.set_num_threads(2)

def check(i):
    out, lse = ops.partial_attention(*inputs[i], backend="cpu")
    assert torch.equal(out, serial[i][0]) and torch.equal(lse, serial[i][1]), f"input {i} differs"
"""


def run_child(body: str, spin_us: int | None = None) -> None:
    """body after PRELUDE in a child process at the repository root; spin_us: its pool's spin (None: default)."""
    environment = {**os.environ, **({} if spin_us is None else {"WRITESCOPE_POOL_SPIN_US": str(spin_us)})}
    try:
        result = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True,
                                timeout=CHILD_TIMEOUT_S, cwd=REPO_ROOT, env=environment)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish in {CHILD_TIMEOUT_S} s: a pool job never completed")
    assert result.returncode == 0, result.stderr[-3000:]


def test_spin_is_set_and_read_back_and_bad_values_are_refused_by_name():
    before = _cpu.pool_spin()
    assert before == int(os.environ.get("WRITESCOPE_POOL_SPIN_US") or _cpu.DEFAULT_POOL_SPIN_MICROSECONDS)
    try:
        _cpu.set_pool_spin(0)
        assert _cpu.pool_spin() == 0
        for bad in (-1, 1_000_001):
            with pytest.raises(ValueError, match=r"pool spin must be in \[0, 1000000\] microseconds"):
                _cpu.set_pool_spin(bad)
        assert _cpu.pool_spin() == 0
    finally:
        _cpu.set_pool_spin(before)


@pytest.mark.parametrize("value", ["abc", "-5", "2000000", "10us"])
def test_bad_spin_in_the_environment_fails_the_import_by_name(value):
    result = subprocess.run([sys.executable, "-c", "import writescope._cpu"], capture_output=True, text=True,
                            env={**os.environ, "WRITESCOPE_POOL_SPIN_US": value})
    assert result.returncode != 0
    assert "WRITESCOPE_POOL_SPIN_US must be an integer in [0, 1000000]" in result.stderr


def test_spin_from_the_environment():
    result = subprocess.run([sys.executable, "-c", "from writescope import _cpu; print(_cpu.pool_spin())"],
                            capture_output=True, text=True, env={**os.environ, "WRITESCOPE_POOL_SPIN_US": "35"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "35"


@pytest.mark.parametrize("spin_us", [None, 0])
def test_jobs_back_to_back_and_after_the_workers_sleep_give_the_serial_result(spin_us):
    run_child("""
for n in range(300):
    if n % 3 == 0:
        time.sleep(4 * SPIN_S + 1e-3)  # the workers went to sleep: this job wakes them
    check(n % len(inputs))  # otherwise posted while they poll
""", spin_us)


def test_an_idle_pool_sleeps():
    # One spinning thread would burn the whole pause (0.5 s); the process's other threads (torch's
    # idle pool) next to nothing.
    run_child("""
check(0)
time.sleep(10 * SPIN_S + 0.01)
before = time.process_time()  # CPU seconds of every thread of this process
time.sleep(0.5)
burnt = time.process_time() - before
assert burnt < 0.1, f"an idle pool burnt {burnt:.3f} CPU seconds in 0.5 s"
""")


def test_pool_rebuilt_while_its_workers_poll():
    run_child("""
for n in range(100):
    check(n % len(inputs))
    _cpu.set_num_threads(2 + n % 2)  # joins the old workers, at most microseconds after their job
""")


@pytest.mark.parametrize("spin_us", [None, 0])
def test_callers_on_several_threads_each_get_their_own_result(spin_us):
    run_child("""
errors = []

def caller(i):
    try:
        for _ in range(40):
            check(i)
    except BaseException as error:
        errors.append(error)

threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(inputs))]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
""", spin_us)
