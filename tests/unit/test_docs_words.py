"""README's and the docs' words must make sense to a reader of them alone.

Tracker numbers (a hash sign and an issue number) name issues a reader cannot open; the documents say what a
thing is instead, and CHANGELOG.md keeps the history. Fenced blocks (recorded program output,
commands) are not prose and are not checked; a message id ("message #12", as the Django admin
shows it) is not a tracker number. The invariants table of docs/design.md is left to its own
edits (its rows are changed by every capability) and is checked by nobody here yet.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
TRACKER = re.compile(r"(?<![\w/])(?<!message )#\d+\b")
INVARIANT_ROW = re.compile(r"^\| \d+ \|")


def _prose(path: Path) -> list[tuple[int, str]]:
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((n, line))
    return lines


def test_readme_names_no_internal_milestone() -> None:
    found = [f"README.md:{n}: {line.strip()}" for n, line in _prose(README) if TRACKER.search(line)]
    assert found == []


def test_the_docs_prose_names_no_tracker_number() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in DOCUMENTS
        for n, line in _prose(path)
        if TRACKER.search(line) and not (path.name == "design.md" and INVARIANT_ROW.match(line))
    ]
    assert found == []


def test_the_package_names_no_tracker_number() -> None:
    """Comments and docstrings say what is and name invariants; history is the CHANGELOG's."""
    package = Path(__file__).resolve().parents[2] / "outbox_celery"
    tracker = re.compile(r"(?<![\w&/#])#\d{1,3}\b")
    found = [
        f"{path.relative_to(package.parent)}:{n}: {line.strip()}"
        for path in sorted(package.rglob("*"))
        if path.suffix in {".py", ".sql", ".html"}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if tracker.search(line)
    ]
    assert found == []


def test_no_tracked_file_names_a_tracker_number() -> None:
    """Tests, benchmarks, chaos, examples and the build files say what is, as the package does:
    a hash sign and an issue number name nothing a reader can open. A message id (``message``
    before it, as the Django admin shows one) and an ordering key's text are not tracker numbers.
    """
    tracker = re.compile(r"(?<![\w&/#])(?<!message )(?<!tenant )#\d{1,3}\b")
    listed = subprocess.run(
        ["git", "ls-files", "benchmarks", "tests", "chaos", "examples", ".ci", "pyproject.toml", "Makefile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    suffixes = {".py", ".sql", ".html", ".toml", ".md", ".cfg", ".ini", ".yml", ".yaml", ".sh", ""}
    found = [
        f"{name}:{n}: {line.strip()}"
        for name in listed.stdout.splitlines()
        if Path(name).suffix in suffixes and (ROOT / name).is_file()
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if tracker.search(line)
    ]
    assert found == []
