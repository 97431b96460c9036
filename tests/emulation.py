"""Linux arm64 for the platform tests: a Debian bookworm arm64 root run under qemu-user-static (`make arm64`
sets up the emulation), with python3 and the device lock's aarch64 packages in /opt/venv."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_LOCK = ROOT / "requirements" / "device-lock.txt"

ARM64_ROOT_CACHE = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "odt"
                    / f"debian-bookworm-arm64-{hashlib.sha256(DEVICE_LOCK.read_bytes()).hexdigest()[:12]}.tar")
"""The root, built once per machine and device lock (debootstrap took 5.5 min here, the packages 2 min under
emulation), outside the clone."""
ARM64_PLATFORMS = ["--only-binary", ":all:", "--platform", "manylinux_2_28_aarch64", "--platform",
                   "manylinux2014_aarch64", "--platform", "manylinux_2_17_aarch64", "--python-version", "3.11",
                   "--implementation", "cp"]  # fmt: skip
"""The host pip's options for aarch64 wheels (it evaluates environment markers for the host, not for these)."""
SITE = Path("opt/venv/lib/python3.11/site-packages")


def in_arm64(root: Path, command: str, timeout: float = 1800) -> str:
    """Run a shell command in the arm64 root; its stdout. /proc is mounted in a mount namespace of its own (gone
    with the process; onnxruntime 1.32 opens external data through /proc/self/fd); /sys stays unmounted: with
    the host's, `import onnxruntime` segfaults under qemu."""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root", "LANG": "C.UTF-8"}
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    inside = 'mount -t proc proc "$1/proc" && exec "$2" "$1" /bin/sh -c "$3"'
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", inside, "sh",
                             str(root), chroot, command], capture_output=True, text=True, timeout=timeout,
                            env=env)  # fmt: skip
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def host_pip_into(root: Path, *arguments: str) -> None:
    """Install aarch64 wheels into the root's /opt/venv with the host's pip (emulated pip took 2 min here, and
    cannot verify the TLS of this network)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *ARM64_PLATFORMS,
                    "--target", str(root / SITE), *arguments], check=True, capture_output=True)


def arm64_root(where: Path) -> Path:
    """Unpack the cached arm64 root into ``where`` (building the cache first when it is absent)."""
    assert Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists(), "arm64 emulation is off: run `make arm64` as root"
    root = where / "root"
    if not ARM64_ROOT_CACHE.is_file():
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
        subprocess.run([debootstrap, "--arch=arm64", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                        str(root), "http://deb.debian.org/debian"], check=True, capture_output=True, timeout=3600)
        in_arm64(root, "python3 -m venv /opt/venv")
        host_pip_into(root, "--upgrade", "-r", str(DEVICE_LOCK))  # the SDK's wheel: install_wheel, in the test
        ARM64_ROOT_CACHE.parent.mkdir(parents=True, exist_ok=True)
        partial = ARM64_ROOT_CACHE.with_suffix(".partial")
        subprocess.run(["tar", "-cf", str(partial), "-C", str(root), "."], check=True)
        os.replace(partial, ARM64_ROOT_CACHE)
    else:
        root.mkdir()
        subprocess.run(["tar", "-xf", str(ARM64_ROOT_CACHE), "-C", str(root)], check=True)
    return root


def install_wheel(root: Path, wheel: Path) -> None:
    """The SDK's built wheel into the root's /opt/venv (its dependencies are there already)."""
    (root / "work").mkdir(exist_ok=True)
    shutil.copyfile(wheel, root / "work" / wheel.name)
    assert in_arm64(root, "uname -m").strip() == "aarch64"
    in_arm64(root, f"/opt/venv/bin/pip install -q --disable-pip-version-check --no-index --no-deps /work/{wheel.name}")
