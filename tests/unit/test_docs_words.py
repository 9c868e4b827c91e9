"""README's words must make sense to a reader of README alone (#26, item 9).

Internal milestones ("#10", "before #12") name issues a reader cannot open; README says what
changed instead. (docs/ keep their history sections, where the numbers are explained.)
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_names_no_internal_milestone() -> None:
    found = [
        f"README.md:{n}: {line.strip()}"
        for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), start=1)
        if re.search(r"(?<![\w/])#\d+\b", line)
    ]
    assert found == []
