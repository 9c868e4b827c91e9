"""The release files: what ``make dist`` builds is complete, described and versioned once.

The wheel is built here (setuptools, no build isolation: a few seconds) and read as PyPI and
pip will: every data file the package ships in its source tree (SQL, migrations, templates,
py.typed) is inside, the metadata passes ``twine check --strict`` and names the supported
Python and PostgreSQL versions, and the version is the one ``outbox_celery.__version__`` says
(pyproject.toml reads it from there; it writes no version of its own). The install of that
wheel into a clean virtualenv is ``make dist-check`` (.ci/run runs it).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import outbox_celery

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "outbox_celery"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the dev extra's `build` is not installed")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    [built] = out.glob("*.whl")
    return built


def _metadata(wheel: Path) -> tuple[list[str], Parser, str]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        return names, Parser(), z.read(meta).decode("utf-8")


def test_the_version_is_written_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"], "pyproject.toml must not repeat the version"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "outbox_celery.__version__"}


def test_the_wheel_holds_every_data_file_of_the_package(wheel: Path) -> None:
    names, _, _ = _metadata(wheel)
    shipped = {
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert "outbox_celery/py.typed" in shipped
    assert any(n.startswith("outbox_celery/db/sql/migrations/") for n in shipped)
    missing = sorted(shipped - set(names))
    assert missing == [], f"not in the wheel (add them to [tool.setuptools.package-data]): {missing}"
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(modules - set(names)) == []


def test_the_wheel_metadata_describes_the_release(wheel: Path) -> None:
    _, parser, text = _metadata(wheel)
    meta = parser.parsestr(text)
    assert meta["Name"] == "outbox-celery"
    assert meta["Version"] == outbox_celery.__version__
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "MIT"
    assert meta["Description-Content-Type"] == "text/markdown"
    classifiers = meta.get_all("Classifier") or []
    for wanted in ("Typing :: Typed", "Framework :: Celery", "Programming Language :: Python :: 3.11"):
        assert wanted in classifiers, classifiers
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls), urls
    # The long description is README, which names the supported PostgreSQL versions.
    assert "PostgreSQL 13 or later" in meta.get_payload()


def test_twine_accepts_the_wheel(wheel: Path) -> None:
    pytest.importorskip("twine", reason="the dev extra's `twine` is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
