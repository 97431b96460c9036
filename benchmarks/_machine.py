"""The machine a benchmark ran on, for the README."""

from __future__ import annotations

import os
import platform


def machine() -> dict[str, object]:
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            name = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "python": platform.python_version(), "os": platform.platform()}
