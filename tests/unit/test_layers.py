"""Import boundaries inside the package, read from the source (no import side effects)."""

from __future__ import annotations

import ast
from pathlib import Path

import outbox_celery

PACKAGE = Path(outbox_celery.__file__).parent


def _imports(path: Path) -> set[str]:
    """Absolute names of the package modules ``path`` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def test_no_production_module_imports_the_test_helpers() -> None:
    offenders = sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "testing.py" and "outbox_celery.testing" in _imports(path)
    )
    assert offenders == []
