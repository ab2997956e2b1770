import pathlib
import subprocess
import sys

import pytest

import writescope

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def test_every_python_package_of_the_source_tree_is_installed():
    """A regular (not editable) install, a wheel for a Ray runtime env or an image, holds only the
    packages pyproject lists: every folder with an __init__.py under a mapped one must be listed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package supports 3.10
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
