"""C++ probes that tools compile on demand with the host's compiler (g++ or CXX), cached by source,
compiler and flags, and the CPU flags they need."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess

from writescope import calibration


def check_x86_flags(needed: tuple[str, ...], what: str) -> None:
    """ValueError unless this is an x86-64 CPU whose /proc/cpuinfo lists every flag in `needed`;
    `what` says what needs them ("the loops need AVX2 and FMA")."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"{what}: this machine is {platform.machine()}, not x86_64")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    missing = [flag for flag in needed if flag not in flags]
    if missing:
        raise ValueError(f"{what}; this CPU lacks {', '.join(missing)}")


def build(source: str, flags: tuple[str, ...], name: str, compiler: str | None = None) -> str:
    """`source` compiled with `flags` into the cache directory's folder `name`, once per source,
    compiler and flags; the executable's path."""
    compiler = compiler or os.environ.get("CXX", "g++")
    path = shutil.which(compiler)
    if path is None:
        raise ValueError(f"no C++ compiler {compiler!r} on PATH (set CXX to one that takes g++'s flags)")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read() + path.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = os.path.join(os.path.dirname(calibration.cache_path()), name)
    executable = os.path.join(out_dir, f"{name}_{digest}")
    if not os.path.exists(executable):
        os.makedirs(out_dir, exist_ok=True)
        partial = f"{executable}.{os.getpid()}"
        done = subprocess.run([path, *flags, "-o", partial, source], capture_output=True, text=True)
        if done.returncode != 0:
            raise ValueError(f"{compiler} could not compile {os.path.basename(source)} with {' '.join(flags)} "
                             f"(exit {done.returncode}): {done.stderr.strip()[-500:]}")
        os.replace(partial, executable)  # atomic: a concurrent build never runs a half-written file
    return executable


def executable_or_exit(parser, check_host, build) -> str:
    """build()'s executable once check_host() passes; parser.error with what the host or its
    compiler lacks otherwise."""
    try:
        check_host()
        return build()
    except ValueError as error:
        parser.error(str(error))
