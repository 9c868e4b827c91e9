"""README's and the docs' words must make sense to a reader of them alone.

Tracker numbers ("#10", "before #12") name issues a reader cannot open; the documents say what a
thing is instead, and CHANGELOG.md keeps the history. Fenced blocks (recorded program output,
commands) are not prose and are not checked; a message id ("message #12", as the Django admin
shows it) is not a tracker number. The invariants table of docs/design.md is left to its own
edits (its rows are changed by every capability) and is checked by nobody here yet.
"""

from __future__ import annotations

import re
from pathlib import Path

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
    """Comments and docstrings say what is and name invariants; history (``#21``) is the CHANGELOG's."""
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
