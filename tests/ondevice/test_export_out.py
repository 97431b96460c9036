"""`odt export --out`: it writes a new path, or with --force what an earlier export wrote; never a
user's file or folder, a link's target, a device, the artifacts or the working directory. Folders
arrive whole, a killed export's leftovers go at the next one, and a full disk leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice.cli import main
from ondevice.files import EXPORT_RECORD, sha256_file, written_by_odt
from tests.ondevice.test_formats import lora_trained  # noqa: F401  (a module fixture: LoRA artifacts, trained)


def _user_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the user's own bytes")
    return path


def _user_folder(path: Path) -> Path:
    _user_file(path / "config.json")
    _user_file(path / "adapter_config.json")
    return path


def _symlink(path: Path) -> Path:
    path.symlink_to(_user_file(path.with_name("target.onnx")))
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` with its bytes (or its kind), to show that nothing changed."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = f"link to {os.readlink(path)}"
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "fifo" if path.is_fifo() else "dir"
    return found


READS = "or inside it, which this command reads"
REFUSED = [
    # (what --out is, how it is made, more options, what the error says)
    ("a user's .onnx", lambda t, a: _user_file(t / "m.onnx"), [], "already exists; pass --force"),
    ("a user's .onnx, --force", lambda t, a: _user_file(t / "m.onnx"), ["--force"], "was not written by odt,"),
    ("a user's .safetensors, --force", lambda t, a: _user_file(t / "m.safetensors"), ["--force"], "not written by"),
    ("a user's folder", lambda t, a: _user_folder(t / "p"), ["--format", "peft"], "already exists"),
    ("a user's folder, --force", lambda t, a: _user_folder(t / "p"), ["--format", "peft", "--force"],
     "holds files odt did not write"),
    ("an empty name, peft", lambda t, a: "", ["--format", "peft"], "--out is empty"),
    ("an empty name, onnx", lambda t, a: "", ["--format", "onnx"], "--out is empty"),
    ("the manifest", lambda t, a: a / "manifest.json", ["--format", "onnx", "--force"], READS),
    ("the artifact directory", lambda t, a: a, ["--format", "peft", "--force"], READS),
    ("a file in the artifacts", lambda t, a: a / "sub" / "m.onnx", [], READS),
    ("a symbolic link", lambda t, a: _symlink(t / "link.onnx"), ["--force"], "symbolic link"),
    ("a pipe", lambda t, a: _fifo(t / "pipe.onnx"), ["--force"], "not a regular file"),
    ("a directory", lambda t, a: _user_folder(t / "d.onnx"), ["--force"], "not a regular file"),
    ("a device", lambda t, a: Path("/dev/full"), ["--force", "--format", "onnx"], "not a regular file"),
    ("the working directory", lambda t, a: ".", ["--format", "peft", "--force"], "the working directory"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "make", "options", "said"), REFUSED, ids=[r[0] for r in REFUSED])
def test_export_refuses_what_it_did_not_write(lora_trained, tmp_path, monkeypatch, capsys, what, make, options, said):  # noqa: F811
    root, _, _ = lora_trained
    artifacts = tmp_path / "artifacts"
    artifacts.symlink_to(root / "a")  # the module's artifacts, by another name
    users = tmp_path / "users"
    users.mkdir()
    monkeypatch.chdir(users)
    out = make(users, artifacts)
    before, source = _snapshot(users), _snapshot(root / "a")
    code = main(["export", str(artifacts), "--checkpoint", str(root / "ckpt"), "--out", str(out), *options])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert _snapshot(users) == before and _snapshot(root / "a") == source


@pytest.mark.parametrize(("name", "kind"), [("m.onnx", None), ("M.SAFETENSORS", None), ("adapter", "peft")])
def test_an_earlier_export_is_replaced_with_force_only(lora_trained, tmp_path, capsys, name, kind):  # noqa: F811
    root, _, _ = lora_trained
    argv = ["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--out", str(tmp_path / name),
            *(["--format", kind] if kind else [])]  # fmt: skip
    assert main(argv) == 0
    out = tmp_path / name
    first = _snapshot(tmp_path)
    if kind:
        record = (out / EXPORT_RECORD).read_text()
        assert sorted(p.name for p in out.iterdir()) == sorted(["adapter_config.json", "adapter_model.safetensors",
                                                                 EXPORT_RECORD])  # fmt: skip
        assert all(sha256_file(out / n) in record for n in ("adapter_config.json", "adapter_model.safetensors"))
    else:
        assert written_by_odt(out)
    assert main(argv) == 2 and "already exists; pass --force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    assert _snapshot(tmp_path).keys() == first.keys()  # the same files, nothing left beside them


def test_a_killed_exports_leftovers_go_at_the_next_export(lora_trained, tmp_path):  # noqa: F811
    root, _, _ = lora_trained
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = [tmp_path / f".m.onnx.{dead.pid}.tmp", tmp_path / f".m.safetensors.{dead.pid}.abcd.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a model")
    (tmp_path / f".p.{dead.pid}.x1.partial").mkdir()
    alive = tmp_path / f".m.onnx.{os.getppid()}.tmp"  # a live writer's file stays
    alive.write_bytes(b"being written")
    for out, kind in (("m.onnx", "onnx"), ("m.safetensors", "safetensors"), ("p", "peft")):
        assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--out", str(tmp_path / out),
                     "--format", kind]) == 0  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.onnx", "m.safetensors", "p", alive.name])


def test_a_full_disk_leaves_no_half_folder(lora_trained, tmp_path):  # noqa: F811
    """A real write failure (the file-size limit, set once the checkpoint is loaded): a typed error,
    and neither a folder nor a staging folder left."""
    root, _, _ = lora_trained
    code = f"""
import resource, signal
from ondevice import CheckpointError, Trainer
from ondevice.formats import save_peft
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
trainer = Trainer.load({str(root / "a")!r}, checkpoint={str(root / "ckpt" / "latest.ckpt")!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))
try:
    save_peft(trainer, {str(tmp_path / "p")!r})
except CheckpointError as exc:
    print("refused:", exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused: cannot write") and "nothing was written" in result.stdout
    assert list(tmp_path.iterdir()) == []


PREDICT_REFUSED = [
    ("a user's .npz", lambda t, a: _user_file(t / "p.npz"), [], "already exists; pass --force"),
    ("a user's .npz, --force", lambda t, a: _user_file(t / "p.npz"), ["--force"], "was not written by odt,"),
    ("the manifest", lambda t, a: a / "manifest.json", ["--force"], READS),
    ("a pipe", lambda t, a: _fifo(t / "pipe.npz"), ["--force"], "not a regular file"),
    ("a device", lambda t, a: Path("/dev/full"), ["--force"], "not a regular file"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "make", "options", "said"), PREDICT_REFUSED, ids=[r[0] for r in PREDICT_REFUSED])
def test_predict_out_refuses_what_it_did_not_write(lora_trained, tmp_path, capsys, what, make, options, said):  # noqa: F811
    root, _, _ = lora_trained
    data = tmp_path / "x.npz"
    np.savez(data, x=np.ones((4, 8), np.float32))
    users = tmp_path / "users"
    users.mkdir()
    out = make(users, root / "a")
    before, source = _snapshot(users), _snapshot(root / "a")
    code = main(["predict", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--data", str(data),
                 "--out", str(out), *options])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert _snapshot(users) == before and _snapshot(root / "a") == source


def test_predict_replaces_its_own_npz_with_force(lora_trained, tmp_path, capsys):  # noqa: F811
    root, _, _ = lora_trained
    data, out = tmp_path / "x.npz", tmp_path / "p.npz"
    np.savez(data, x=np.ones((4, 8), np.float32))
    argv = ["predict", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--data", str(data), "--out", str(out)]
    assert main(argv) == 0 and written_by_odt(out)
    first = dict(np.load(out))
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    assert sorted(np.load(out)) == sorted(first)  # the outputs only: the mark is the zip's comment
