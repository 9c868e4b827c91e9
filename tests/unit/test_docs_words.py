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


# A hash sign and up to three digits, not inside a word, an HTML entity or a link to another
# project's issue (``owner/name#N``); a message id (as the Django admin shows one) and the test
# ordering key ``tenant`` + hash + digit (text that must be escaped) are not tracker numbers.
TRACKED_TRACKER = re.compile(r"(?<![\w&/#])(?<!message )(?<!tenant )#\d{1,3}\b")
# The package, README.md and docs/ have their own checks above (docs skip fenced recorded output).
CHECKED_ELSEWHERE = ("outbox_celery/", "docs/", "README.md")


def _tracked_text_files() -> list[str]:
    """Every tracked file outside CHECKED_ELSEWHERE that is text (no NUL byte)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return [
        name
        for name in sorted(listed.stdout.decode().split("\0"))
        if name
        and not name.startswith(CHECKED_ELSEWHERE)
        and (ROOT / name).is_file()
        and b"\0" not in (ROOT / name).read_bytes()
    ]


def test_no_tracked_file_names_a_tracker_number() -> None:
    """Tests, benchmarks, chaos, examples, monitoring, the CHANGELOG and the build files say what
    is, as the package does: a hash sign and an issue number name nothing a reader can open.
    """
    found = [
        f"{name}:{n}: {line.strip()}"
        for name in _tracked_text_files()
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if TRACKED_TRACKER.search(line)
    ]
    assert found == []


def test_the_tracked_file_check_sees_citations_and_the_files() -> None:
    """The check above would not pass vacuously: its pattern finds the citations the rule forbids
    (built here so that this file holds none) and spares the exemptions, and the files it reads
    include the ones the rule is about."""
    h = "#"
    for cited in (
        f"(see {h}6)",
        f"before {h}12",
        f"({h}22, DESIGN invariant 21)",
        f"{h}21 item 5",
        f"x{h}9"[1:],
    ):
        assert TRACKED_TRACKER.search(cited), cited
    for spared in (f"message {h}12", f"&{h}39;", f"celery/celery{h}9054", f"tenant {h}1 & co", f"{h}1f77b4"):
        assert not TRACKED_TRACKER.search(spared), spared
    names = set(_tracked_text_files())
    assert {
        "CHANGELOG.md",
        "pyproject.toml",
        "Makefile",
        "benchmarks/__main__.py",
        "tests/conftest.py",
    } <= names
    assert not any(name.startswith(CHECKED_ELSEWHERE) or name.endswith(".png") for name in names)
