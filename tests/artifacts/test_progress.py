"""`odt generate` says what it is doing: each stage as it starts and ends (piped: one line each on stdout), in
the order it runs; a failure's stderr stays its one error line; --json keeps stdout to the manifest; the library
prints nothing."""

from __future__ import annotations

import json
import re

from artifacts import generate
from artifacts.progress import note, reporting, stage
from ondevice.cli import main

MODEL = ["--model", "samples/digits/model.py:build", "--input", "input:32x64:float32"]


def _stages(err: str) -> list[tuple[str, str]]:
    """(stage, "start" or "end") per line of the piped form."""
    found = []
    for line in err.splitlines():
        if m := re.fullmatch(r"odt generate: (.+) \.\.\.", line):
            found.append((m.group(1), "start"))
        elif m := re.fullmatch(r"odt generate: (.+): \d+\.\d s", line):
            found.append((m.group(1), "end"))
    return found


def test_generate_reports_each_stage_in_order_when_piped(tmp_path, capsys):
    assert main(["generate", *MODEL, "--out", str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    stages = _stages(captured.out)
    names = list(dict.fromkeys(name for name, _ in stages))
    assert names[0] == "exporting to ONNX" and names[-1] == "publishing", names
    assert any(n.startswith("gradient graphs") for n in names) and "portable graphs" in names
    assert any(n.startswith("verifying against PyTorch on") for n in names)
    assert all(stages.count((n, "start")) == stages.count((n, "end")) == 1 for n in names), stages  # each ends
    assert "odt generate:" not in captured.err and "artifacts: " in captured.out.splitlines()[-1]


def test_generate_json_is_only_json(tmp_path, capsys):
    assert main(["generate", *MODEL, "--out", str(tmp_path / "a"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["name"] == "a" and captured.err == ""


def test_a_failed_stage_says_so_and_the_library_is_quiet(tmp_path, capsys):
    with reporting():
        try:
            with stage("outer"), stage("inner"):
                note("a figure")
                raise RuntimeError("boom")
        except RuntimeError:
            pass
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "odt generate: outer ..." and lines[-1].startswith("odt generate: outer: failed after")
    assert "odt generate:   a figure" in lines
    assert any(re.match(r"odt generate:   inner: failed after", x) for x in lines)
    import torch

    from samples.digits.model import build

    generate(build(), {"input": torch.randn(32, 64)}, tmp_path / "quiet", verify=False)
    assert capsys.readouterr() == ("", "")
