"""The extension's build: editing a kernel header alone rebuilds it (the kernels live in headers,
which setuptools does not scan; a stale extension silently runs the old kernel)."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pybind11  # noqa: F401 - setup.py imports it; the test extras install it, so this test never skips
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tries_to_compile(workdir: str) -> bool:
    """Whether `setup.py build_ext --inplace` would compile: with a compiler that always fails, a
    build that compiles exits non-zero and one that finds the extension up to date exits 0."""
    env = dict(os.environ, CC="false", CXX="false")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode != 0


def _built_extension(workdir: str) -> str:
    # setuptools builds into build/lib.<platform>-<tag>/ and checks that file's age against its inputs
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    build_lib = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    return os.path.join(workdir, "build", build_lib, "writescope", "_cpu" + suffix)


@pytest.mark.parametrize("header", ["cpp/include/writescope/paired_kernel.h", "cpp/src/launcher.h"])
def test_an_edited_header_rebuilds_the_extension(tmp_path, header):
    work = str(tmp_path)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), work)
    shutil.copytree(os.path.join(REPO, "cpp"), os.path.join(work, "cpp"))
    os.makedirs(os.path.join(work, "core"))  # where --inplace copies the built extension
    inputs = [p for p in glob.glob(os.path.join(work, "cpp", "**", "*"), recursive=True) if os.path.isfile(p)]
    then = 1_700_000_000
    for path in inputs:
        os.utime(path, (then, then))
    built = _built_extension(work)
    os.makedirs(os.path.dirname(built))
    open(built, "wb").close()
    os.utime(built, (then + 10, then + 10))
    assert not _tries_to_compile(work), "an extension newer than every source should be up to date"
    os.utime(os.path.join(work, header), (then + 20, then + 20))
    assert _tries_to_compile(work), f"{header} edited after the build did not rebuild the extension"
