"""The documentation: every `odt` command in a fenced sh block parses with the real CLI, every
relative link and snippet resolves, and the README stays short."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ondevice.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(page: Path) -> list[tuple[int, str]]:
    """(line, command) of each `odt ...` line in the page's ```sh blocks (continuations joined)."""
    found, block, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            block = [] if block is None and line.strip() in ("```sh", "```bash") else None
            continue
        if block is None:
            continue
        text = line.split(" #", 1)[0].rstrip()
        if block and block[-1].endswith("\\"):
            block[-1] = block[-1][:-1] + " " + text.strip()
        else:
            block.append(text.strip())
            start = number
        if block[-1].startswith("odt ") and not block[-1].endswith("\\"):
            found.append((start, block[-1]))
    return found


COMMANDS = [(page, line, command) for page in PAGES for line, command in _commands(page)]


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20 and {c.split()[1] for _, _, c in COMMANDS} >= {"generate", "train", "fl", "bundle"}


@pytest.mark.parametrize("page, line, command", COMMANDS, ids=[f"{p.name}:{n}" for p, n, _ in COMMANDS])
def test_every_documented_command_parses(page, line, command, capsys):
    try:
        _parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exc:
        pytest.fail(f"{page.name}:{line}: `{command}` does not parse: {capsys.readouterr().err.strip()[-300:]} ({exc})")


def test_relative_links_resolve_and_the_readme_is_short():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_site_builds_strictly(tmp_path):
    """Broken links, missing pages and missing result snippets fail the build."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "errors" / "index.html").read_text().count("latest.ckpt") > 2
