"""Fault benchmark: bit flips, kill -9 loops and hostile uploads against the real runtime and bridge.

Run: .venv-classic/bin/python -m benchmarks.faults [--out benchmarks/results]
Writes faults.json and faults.md (the README's reliability table). Every figure is a count or a
measurement of this run; nothing is assumed.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._machine import machine  # noqa: E402

ODT = str(Path(sys.executable).parent / "odt")


def _artifacts(work: Path) -> Path:
    from artifacts import generate
    from samples.digits.model import build

    generate(build(), {"input": torch.randn(32, 64)}, work / "artifacts")
    return work / "artifacts"


def bit_flips(artifacts: Path, work: Path, count: int = 64) -> dict[str, int]:
    from ondevice import CheckpointError, Trainer

    path = Trainer.load(artifacts).save(work / "flip.ckpt")
    original = path.read_bytes()
    accepted = other = 0
    for index, position in enumerate(np.linspace(0, len(original) - 1, count).astype(int)):
        damaged = bytearray(original)
        damaged[position] ^= 1 << (index % 8)
        target = work / f"flip{index}.ckpt"
        target.write_bytes(bytes(damaged))
        try:
            Trainer.load(artifacts, checkpoint=target)
            accepted += 1
        except CheckpointError:
            pass
        except Exception:  # noqa: BLE001 - counted: anything but the typed refusal is a finding
            other += 1
    return {"flips": count, "accepted": accepted, "untyped_errors": other}


SAVER = """
import sys
from ondevice import Trainer
t = Trainer.load(sys.argv[1])
print("ready", flush=True)
while True:
    t.epoch += 1
    t.save(sys.argv[2])
"""


def kills_during_saves(artifacts: Path, work: Path, kills: int = 55) -> dict[str, int]:
    from ondevice import Trainer

    path = work / "kill.ckpt"
    unloadable = orphans_after_next_save = empty = missing = 0
    rng = np.random.default_rng(0)
    for _ in range(kills):
        process = subprocess.Popen([sys.executable, "-c", SAVER, str(artifacts), str(path)], stdout=subprocess.PIPE)
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.02, 0.4)))
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        candidates = [p for p in (path, path.with_name(path.name + ".previous")) if p.exists()]
        empty += not candidates
        missing += not path.exists()
        for candidate in candidates:
            try:
                Trainer.load(artifacts, checkpoint=candidate)
            except Exception:  # noqa: BLE001
                unloadable += 1
    Trainer.load(artifacts).save(path)
    orphans_after_next_save = len(list(work.glob(".kill.ckpt.*.tmp")))
    return {"kills": kills, "left_no_checkpoint": empty, "left_latest_missing": missing,
            "unloadable_checkpoints": unloadable,
            "orphan_temp_files_after_next_save": orphans_after_next_save}  # fmt: skip


def reads_during_saves(artifacts: Path, work: Path, reads: int = 30) -> dict[str, int]:
    """`odt evaluate --checkpoint` run again and again while another process saves that checkpoint."""
    from ondevice import Trainer

    data = work / "eval.npz"
    rng = np.random.default_rng(0)
    np.savez(data, input=rng.random((64, 64), dtype=np.float32), labels=rng.integers(0, 10, 64))
    checkpoint = work / "reads"
    Trainer.load(artifacts).save(checkpoint / "latest.ckpt")
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(artifacts), str(checkpoint / "latest.ckpt")],
                             stdout=subprocess.PIPE)  # fmt: skip
    assert saver.stdout is not None and saver.stdout.readline().strip() == b"ready"
    failed = 0
    try:
        for _ in range(reads):
            result = subprocess.run([ODT, "evaluate", str(artifacts), "--data", str(data), "--checkpoint",
                                     str(checkpoint), "--json"], capture_output=True, text=True)  # fmt: skip
            failed += result.returncode != 0
    finally:
        saver.kill()
        saver.wait()
    return {"reads": reads, "failed": failed}


def force_targets(artifacts: Path, work: Path) -> dict[str, int]:
    """`odt generate`/`odt bundle --force` aimed at what odt did not write: user files deleted."""
    home = work / "home" / "project"
    (home / "mine").mkdir(parents=True)
    (home / "notes.txt").write_text("a user's file")
    (home / "mine" / "thesis.tex").write_text("years of work")
    (home.parent / "other.txt").write_text("another")
    before = {p for p in home.parent.rglob("*") if p.is_file()}
    targets = ["", ".", "..", "mine", "notes.txt"]
    refused = 0
    for target in targets:
        for command in (["bundle", str(artifacts)], ["generate", "--model", str(artifacts / "eval_model.onnx")]):
            result = subprocess.run([ODT, *command, "--out", target, "--force"], cwd=home, capture_output=True)
            refused += result.returncode != 0
    deleted = len(before - {p for p in home.parent.rglob("*") if p.is_file()})
    return {"attempts": 2 * len(targets), "refused": refused, "user_files_deleted": deleted}


def _bridge(bundle: Path, state: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "ODT_BRIDGE_SECRET": "relay", "ODT_BRIDGE_ENROLMENT": "enrol"}
    command = [ODT, "bridge", "serve", str(bundle), "--port", str(port), "--state", str(state)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=1).close()
            return process
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("bridge did not start")


def _call(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data


def bridge_restarts(artifacts: Path, work: Path, rounds: int = 10) -> dict[str, int]:
    """Each round: a task handed out, the device pulls it, the bridge is killed -9 and restarted,
    the device pushes its update, the relay must get it."""
    from federated.processes import free_port
    from mobile_bridge import make_bundle

    make_bundle(artifacts, work / "bundle")
    size = json.loads((work / "bundle" / "bundle.json").read_text())["weights"]["size"]
    port, state = free_port(), work / "bridge.db"
    process = _bridge(work / "bundle", state, port)
    _, data = _call(port, "POST", "/v1/devices", json.dumps({"name": "phone", "enrolment": "enrol"}).encode(),
                    {"Content-Type": "application/json"})  # fmt: skip
    device = {"Authorization": f"Bearer {json.loads(data)['token']}"}
    description = json.loads(_call(port, "GET", "/v1/bundle", headers=device)[1])
    relay = {"X-Relay-Secret": "relay", "Content-Type": "application/json"}
    lost = 0
    for round_ in range(1, rounds + 1):
        task = {"artifacts_sha256": description["artifacts_manifest_sha256"], "round": round_, "timeout_s": 600,
                "weights_b64": base64.b64encode(np.zeros(size, "<f4").tobytes()).decode()}  # fmt: skip
        task_id = json.loads(_call(port, "POST", "/internal/devices/phone/tasks", json.dumps(task).encode(), relay)[1])[
            "task_id"
        ]
        _call(port, "GET", "/v1/task", headers=device)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process = _bridge(work / "bundle", state, port)
        query = f"/v1/tasks/{task_id}/update?num_examples=5&bundle_sha256={description['manifest_sha256']}"
        pushed, _ = _call(port, "POST", query, np.full(size, round_, "<f4").tobytes(),
                          {**device, "Content-Type": "application/octet-stream"})  # fmt: skip
        status, data = _call(port, "GET", f"/internal/tasks/{task_id}/update", headers=relay)
        lost += not (pushed == 202 and status == 200 and json.loads(data)["num_examples"] == 5)
    process.kill()
    process.wait()
    return {"kills": rounds, "updates_lost": lost}


def chunked_upload(artifacts: Path, work: Path, megabytes: int = 400) -> dict[str, float]:
    from federated.processes import free_port

    port = free_port()
    process = _bridge(work / "bundle", work / "upload.db", port)
    status_path = Path(f"/proc/{process.pid}/status")

    def rss() -> int:
        return int(next(line for line in status_path.read_text().splitlines() if line.startswith("VmRSS")).split()[1])

    before = rss()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.putrequest("POST", "/v1/devices")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    chunk, sent = b"x" * (1 << 20), 0
    try:
        while sent < megabytes << 20:
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    except OSError:
        pass
    status = connection.getresponse().status
    growth = (rss() - before) / 1024
    process.kill()
    process.wait()
    return {"offered_mib": megabytes, "sent_before_cutoff_mib": round(sent / 2**20, 1), "status": status,
            "rss_growth_mib": round(growth, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="odt-faults-") as tmp:
        work = Path(tmp)
        artifacts = _artifacts(work)
        result = {
            "machine": machine(),
            "checkpoint_bit_flips": bit_flips(artifacts, work),
            "kills_during_checkpoint_saves": kills_during_saves(artifacts, work),
            "reads_during_checkpoint_saves": reads_during_saves(artifacts, work),
            "force_at_user_files": force_targets(artifacts, work),
            "bridge_kill_restart": bridge_restarts(artifacts, work),
            "chunked_upload": chunked_upload(artifacts, work),
        }
    out = Path(args.out)
    (out / "faults.json").write_text(json.dumps(result, indent=2) + "\n")
    flips, kills = result["checkpoint_bit_flips"], result["kills_during_checkpoint_saves"]
    reads, force = result["reads_during_checkpoint_saves"], result["force_at_user_files"]
    bridge, upload = result["bridge_kill_restart"], result["chunked_upload"]
    rows = [
        ("single-bit flips of a checkpoint accepted", f"{flips['accepted']} of {flips['flips']} "
         f"({flips['untyped_errors']} untyped errors)"),
        ("kill -9 during checkpoint saves: no checkpoint left / latest.ckpt missing / unloadable",
         f"{kills['left_no_checkpoint']} / {kills['left_latest_missing']} / {kills['unloadable_checkpoints']} of "
         f"{kills['kills']} kills"),
        ("`odt evaluate --checkpoint` while another process saves it: failed reads",
         f"{reads['failed']} of {reads['reads']}"),
        ("`--force` aimed at '', '.', '..', a user's directory and file (generate and bundle): user files deleted",
         f"{force['user_files_deleted']} ({force['refused']} of {force['attempts']} refused)"),
        ("orphaned temporary files after the next save", str(kills["orphan_temp_files_after_next_save"])),
        ("bridge killed -9 between task pull and update push: updates lost", f"{bridge['updates_lost']} of "
         f"{bridge['kills']}"),
        (f"{upload['offered_mib']} MiB chunked upload: HTTP status, sent before cut-off, bridge RSS growth",
         f"{upload['status']}, {upload['sent_before_cutoff_mib']} MiB, {upload['rss_growth_mib']} MiB"),
    ]  # fmt: skip
    table = ["| fault | result |", "|---|---:|", *(f"| {a} | {b} |" for a, b in rows)]
    (out / "faults.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
