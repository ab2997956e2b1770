import subprocess
import sys

import writescope


def test_core_imports_without_ray_or_the_extension():
    code = "import sys, writescope, writescope.ops, writescope.reference, writescope.env; " \
           "print('ray' in sys.modules, 'writescope._cpu' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_the_whole_core_imports_without_ray():
    code = ("import sys, writescope.engine, writescope.inplace_kv_cache, writescope.calibration, "
            "writescope.executor, writescope.topology; print('ray' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False"]


def test_version_is_set():
    assert writescope.__version__.count(".") == 2
