"""Helpers the bridge's process-level tests share."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

WEB = Path(__file__).resolve().parents[2] / "mobile_bridge" / "web"


def wait_for(url: str, process: subprocess.Popen | None = None, timeout: float = 30) -> None:
    """Until ``url`` answers; fails if ``process`` exits first or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and (process is None or process.poll() is None):
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def deploy_with_browser(command: list[str], task: dict, tmp_path: Path, port: int, timeout: float) -> dict:
    """Run ``odt bridge deploy`` (``command``), join its round with a headless browser as browser-1
    (``task`` for run-in-browser.mjs, enrolled with the code the deployment prints), wait for the
    deployment to exit 0 and return the browser's result."""
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert run.stdout is not None
        lines = []
        for line in run.stdout:
            lines.append(line)
            if line.startswith("bridge: open"):
                break
        assert f"http://127.0.0.1:{port}/web/#enrol=" in lines[-1] and "browser-1" in lines[-1], "".join(lines)
        task["bridge"]["enrolment"] = lines[-1].split("#enrol=")[1].split()[0]
        (tmp_path / "task.json").write_text(json.dumps(task))
        driver = ["node", str(WEB / "tools" / "run-in-browser.mjs"), f"http://127.0.0.1:{port}/web/"]
        browser = subprocess.run([*driver, str(tmp_path / "task.json")], capture_output=True, text=True,
                                 timeout=timeout)  # fmt: skip
        rest = run.stdout.read()
        assert run.wait(timeout=120) == 0, "".join(lines) + rest
    finally:
        run.kill()
    device = json.loads(browser.stdout)
    assert device["ok"], browser.stderr[-2000:]
    return device
