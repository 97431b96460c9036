"""Build the portable engine's native update kernel (``ondevice/kernels/update.c``) for every platform the
wheel ships it for, with the ``ziglang`` package's C compiler (one pinned PyPI download that cross-compiles
from any host, where the system's gcc builds only for its own).

The wheel stays pure Python: the libraries are loaded with ctypes (no Python ABI), one per platform in
``ondevice/kernels/<platform>/``. Only platforms where the kernel is tested are built: Linux x86_64 natively,
Linux aarch64 under emulation (``tests/emulation.py``). Elsewhere (macOS, Windows) the engine runs the update
graph. ``python _build/kernels.py`` builds them into the source tree (``make`` does, and the build backend).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "ondevice" / "kernels"
SOURCE = KERNELS / "update.c"
LIBRARY = "libodt_update.so"
TARGETS = {"linux-x86_64": "x86_64-linux-gnu", "linux-aarch64": "aarch64-linux-gnu"}
"""Platform directory (``sys.platform``-``platform.machine()``) -> zig's target triple."""
FLAGS = ["-O3", "-g0", "-s", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-std=c11", "-Wall",
         "-Werror"]  # fmt: skip
"""No fused multiply-add and sqrt as the instruction: the graph's float32 operations, bit for bit."""


def build(force: bool = False) -> list[Path]:
    """Compile the kernel for each of :data:`TARGETS` where the library is missing or older than its source;
    each written to a temporary file and renamed over the old one. Returns the libraries it built."""
    built = []
    for platform, target in TARGETS.items():
        library = KERNELS / platform / LIBRARY
        if force or not library.exists() or library.stat().st_mtime < SOURCE.stat().st_mtime:
            library.parent.mkdir(exist_ok=True)
            partial = library.with_name(f".{LIBRARY}.{os.getpid()}")
            command = [sys.executable, "-m", "ziglang", "cc", "-target", target, *FLAGS, "-o", str(partial),
                       str(SOURCE)]  # fmt: skip
            try:
                subprocess.run(command, check=True, capture_output=True, text=True)
            except subprocess.CalledProcessError as exc:
                partial.unlink(missing_ok=True)
                hint = "pip install ziglang (requirements/lock.txt pins it)" if "ziglang" in exc.stderr else ""
                message = f"error: building the update kernel for {target} failed: {exc.stderr.strip()} {hint}"
                raise SystemExit(message) from None
            os.replace(partial, library)
            built.append(library)
    return built


if __name__ == "__main__":
    for path in build(force="--force" in sys.argv):
        print(f"built {path.relative_to(ROOT)}")
