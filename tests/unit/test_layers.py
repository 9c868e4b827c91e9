"""Import boundaries inside the package, read from the source (no import side effects)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import outbox_celery

PACKAGE = Path(outbox_celery.__file__).parent


@cache
def _imports(path: Path) -> frozenset[str]:
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
    return frozenset(names)


def test_no_production_module_imports_the_test_helpers() -> None:
    offenders = sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "testing.py" and "outbox_celery.testing" in _imports(path)
    )
    assert offenders == []


def _module_path(name: str) -> Path | None:
    """The source file of package module ``name`` (None if it is not a module of the package)."""
    parts = name.split(".")
    if parts[0] != PACKAGE.name or len(parts) == 1:
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _reachable(module: str) -> dict[str, list[str]]:
    """Every name ``module`` imports, directly or through the package modules it imports, each
    with the chain of modules that leads to it.

    The package's ``__init__`` is not followed: any submodule import runs it, whatever the
    submodule imports itself, and it re-exports ``Outbox`` (so ``import outbox_celery`` does
    import Celery). The rules below are about what each module needs.
    """
    chains: dict[str, list[str]] = {module: [module]}
    todo = [module]
    while todo:
        current = todo.pop()
        path = _module_path(current)
        assert path is not None, current
        for name in sorted(_imports(path)):
            if name.split(".")[0] == PACKAGE.name and _module_path(name) is None:
                continue  # the package itself, or a name imported from one of its modules
            if name not in chains:
                chains[name] = [*chains[current], name]
                if _module_path(name) is not None:
                    todo.append(name)
    return chains


# dispatch decides, store runs the SQL, the done batcher and the listener are threads around them,
# handlers checks and records handler registrations: none of them needs Celery, which only
# celery_app (and publisher, celery_config, push, tasks, worker_signals, worker_settings, cli)
# bring in.
CELERY_FREE = ["worker.deliverer", "db.store", "worker.done_batch", "claim.listener", "handlers"]
CELERY = ("celery", "kombu", "billiard")


# The payload codec is kombu's JSON, the serializer of Celery's task arguments (DESIGN invariant
# 27): the one name of kombu the core takes, and only through the codec module.
CODEC = f"{PACKAGE.name}.codec"
KOMBU_JSON = "kombu.utils.json"


def test_the_core_modules_import_no_celery() -> None:
    offenders = {}
    for module in CELERY_FREE:
        for name, chain in _reachable(f"{PACKAGE.name}.{module}").items():
            if name == KOMBU_JSON and chain[-2:] == [CODEC, KOMBU_JSON]:
                continue
            if name.split(".")[0] in CELERY:
                offenders[f"{module} -> {name}"] = " -> ".join(chain)
    assert offenders == {}
    assert KOMBU_JSON in _reachable(f"{PACKAGE.name}.db.store")  # the exception names what it exempts


def _modules_in(folder: str) -> list[str]:
    """The package modules of ``folder`` (its ``__init__`` as the package's own name)."""
    names = (
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in (PACKAGE / folder).rglob("*.py")
    )
    return sorted(names)


def _room(name: str) -> str | None:
    """The folder of package module ``name`` (``None`` for a root module or another name)."""
    path = _module_path(name)
    if path is None or path.parent == PACKAGE:
        return None
    return path.relative_to(PACKAGE).parts[0]


# What operators run (ops/) reads and writes the table through db/ with the package's vocabulary
# (its root modules); neither it nor anything it imports needs Celery or the Celery side (app/).
OPS_ROOMS = {"ops", "db"}


def test_ops_imports_db_and_the_root_vocabulary_only() -> None:
    offenders = {}
    for module in _modules_in("ops"):
        path = _module_path(module)
        assert path is not None
        for name in _imports(path):
            if _room(name) not in (None, *OPS_ROOMS):
                offenders[f"{module} -> {name}"] = "imported"
        for name, chain in _reachable(module).items():
            if name == KOMBU_JSON and chain[-2:] == [CODEC, KOMBU_JSON]:
                continue
            if name.split(".")[0] in CELERY or _room(name) == "app":
                offenders[f"{module} -> {name}"] = " -> ".join(chain)
    assert offenders == {}
    assert _room(f"{PACKAGE.name}.db.statements") == "db"  # the rule reads the rooms it means to


def test_the_cli_finds_and_operates_an_outbox_without_the_celery_side() -> None:
    """The command line imports nothing of ``app/``, type-only imports included: it knows an
    Outbox as an :class:`~outbox_celery.operated.OperatedOutbox`."""
    offenders = {}
    for module in _modules_in("cli"):
        for name, chain in _reachable(module).items():
            if _room(name) == "app" or name.startswith(f"{PACKAGE.name}.app."):
                offenders[f"{module} -> {name}"] = " -> ".join(chain)
    assert offenders == {}


def test_no_module_imports_itself_through_others() -> None:
    """No import circle inside the package, type-only imports included.

    Each module can then be read (and imported) after the ones it names: the publisher, the
    Celery configuration and the push step do not reach back into ``celery_app``, which uses
    them; push describes the outbox it needs as a protocol instead of importing ``Outbox``.
    """
    circles = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if path.name == "__init__.py":
            continue  # every submodule import runs it (see _reachable)
        for name in sorted(_imports(path)):
            if name == module or _module_path(name) in (None, path):
                continue
            back = _reachable(name)
            if module in back:
                circles[module] = " -> ".join([module, *back[module]])
    assert circles == {}


# The modules that compose SQL text: the query files' loader, the one module that runs the
# outbox's queries, the operator commands and the console's bounded reads, the inbox, the
# migrations, the table name's identifiers (invariant 15) and the test helpers that create
# databases.
SQL_MODULES = {
    "db.statements",
    "produce.writes",
    "db.store",
    "db.completer",
    "ops._queries",
    "ops.subscriptions",
    "ops.console",
    "inbox",
    "db.migrations",
    "config",
    "testing",
}


def _uses_psycopg_sql(path: Path) -> bool:
    if any(name == "psycopg.sql" or name.startswith("psycopg.sql.") for name in _imports(path)):
        return True
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "sql"
        and isinstance(node.value, ast.Name)
        and node.value.id == "psycopg"
        for node in ast.walk(tree)
    )


def test_only_the_sql_modules_use_psycopg_sql() -> None:
    users = {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for path in PACKAGE.rglob("*.py")
        if _uses_psycopg_sql(path)
    }
    assert users - SQL_MODULES == set()
    assert "db.store" in users  # the rule reads the imports it means to read


def _sql_attributes(path: Path) -> set[str]:
    """The names ``path`` reads from the query registry module (``_sql.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_sql"
    }


# What may read or fill the SQL files' raw text rather than take the composed statements of
# _sql.queries: the migration runner lists and reads migration files (run once, never named
# statements), and Store fills the replacement texts its caller passes (benchmarks, experiments).
RAW_SQL_READERS = {"db.migrations": {"read", "importlib.resources"}, "db.store": {"fill"}}


def test_only_the_query_registry_reads_the_sql_files() -> None:
    raw = {"read", "named", "fill", "_entries"}
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if module == "db.statements":
            continue
        used = _sql_attributes(path) & raw | {"importlib.resources"} & _imports(path)
        used -= RAW_SQL_READERS.get(module, set())
        if used:
            offenders[module] = sorted(used)
    assert offenders == {}
    assert "queries" in _sql_attributes(PACKAGE / "ops" / "_queries.py")  # the rule reads what it means to
