"""The build backend: setuptools', refusing to build a wheel without the browser client's files, and building
the portable engine's update kernel first (:mod:`kernels`).

``mobile_bridge/web/ort`` (the onnxruntime-web builds the browser client loads) comes from the npm lock by
``make wheel``; a wheel built from a source tree without it would install a bridge whose demo page cannot
load, and pip shows a backend's warnings only when the build fails. So the build fails, saying what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import kernels
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other hook is setuptools' own)

BROWSER_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.wasm", "ort.training.wasm.min.mjs")
"""Files of mobile_bridge/web/ort the browser client cannot start without."""
WITHOUT_BROWSER = "ODT_WHEEL_WITHOUT_BROWSER"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    ort = Path("mobile_bridge") / "web" / "ort"
    missing = [name for name in BROWSER_FILES if not (ort / name).is_file()]
    if missing and os.environ.get(WITHOUT_BROWSER) != "1":
        raise SystemExit(
            f"error: the browser client's onnxruntime-web files are not in {ort} ({', '.join(missing)} missing). "
            f"Build with `make wheel` (it fetches them with npm from mobile_bridge/web/package-lock.json), or set "
            f"{WITHOUT_BROWSER}=1 for a wheel whose bridge has no browser client."
        )
    kernels.build()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    kernels.build()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
