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
    "table",
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


# -- rooms by role ---------------------------------------------------------------------------------
#
# The package's folders, each one role's room, and the rooms each may import. The modules at the
# package's root are its shared vocabulary (settings, errors, the message, the codec, handler
# declarations): they import only each other. Above the rooms stand the package's entry points
# (``__init__``, ``__main__``, ``inbox``, ``testing``, ``metrics``), which may import anything.
BASE = "base"
ROOMS: dict[str, set[str]] = {
    BASE: set(),
    "db": {BASE},
    "produce": {BASE, "db"},
    "claim": {BASE, "db"},
    "worker": {BASE, "db", "produce"},  # a transactional handler's follow-ups are producer writes
    "ops": {BASE, "db"},
    "web": {BASE, "db", "ops"},
    "app": {BASE, "db", "produce", "claim", "worker", "ops"},
    "cli": {BASE, "db", "produce", "claim", "worker", "ops", "app", "web"},
    "contrib": {BASE, "db", "produce", "worker", "ops"},
}
ENTRY_POINTS = {"__init__", "__main__", "inbox", "testing", "metrics", "_moved"}
MAX_FLOORS = 10


def _room_of(module: str) -> str | None:
    """The room of package module ``module`` (``outbox_celery.db.store`` -> ``db``); ``None``
    for an entry point."""
    parts = module.split(".")[1:]
    if not parts or (len(parts) == 1 and parts[0] in ENTRY_POINTS):
        return None
    return parts[0] if len(parts) > 1 or parts[0] in ROOMS else BASE


def _runtime_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports when it runs: module level and inside functions,
    not under ``if TYPE_CHECKING``."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                base = package.rsplit(".", child.level - 1)[0] if child.level else ""
                target = ".".join(p for p in (base, child.module or "") if p)
                subs = [f"{target}.{a.name}" for a in child.names if _module_path(f"{target}.{a.name}")]
                found.update(subs)
                if len(subs) < len(child.names):
                    found.add(target)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {
        name
        for name in found
        if name.split(".")[0] == PACKAGE.name and name != module and _module_path(name) is not None
    }


def _graph() -> dict[str, set[str]]:
    """Every package module and the package modules it imports at run time; a folder's
    ``__init__`` that only re-exports counts as the modules it names."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = _runtime_imports(path) - {PACKAGE.name}
    return graph


def test_each_room_imports_only_the_rooms_below_it() -> None:
    """claim never imports worker nor worker claim, db nothing above it, ops nothing of the
    Celery wiring; the root's vocabulary imports no room."""
    offenders = []
    for module, imports in _graph().items():
        room = _room_of(module)
        if room is None:
            continue
        for name in sorted(imports):
            other = _room_of(name)
            if other is None or (other != room and other not in ROOMS[room]):
                offenders.append(f"{module} ({room}) -> {name} ({other or 'entry point'})")
    assert offenders == []


def test_every_room_below_the_celery_wiring_imports_no_celery() -> None:
    offenders = {}
    for module in _graph():
        if _room_of(module) not in ("ops", "web", "db", "produce", "claim", "worker", BASE):
            continue
        for name, chain in _reachable(module).items():
            if name == KOMBU_JSON and chain[-2:] == [CODEC, KOMBU_JSON]:
                continue
            if name.split(".")[0] in CELERY:
                offenders[f"{module} -> {name}"] = " -> ".join(chain)
    assert offenders == {}


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for a module that imports none of the package, else one more than
    the highest floor it imports (a circle would recurse forever: the circle test runs first)."""
    floors: dict[str, int] = {}

    def floor(module: str, path: tuple[str, ...]) -> int:
        if module in floors:
            return floors[module]
        assert module not in path, " -> ".join([*path, module])
        below = [floor(name, (*path, module)) for name in graph.get(module, ())]
        floors[module] = 1 + max(below, default=0)
        return floors[module]

    for module in graph:
        floor(module, ())
    return floors


def test_the_package_has_at_most_ten_floors() -> None:
    """Floors: the modules on the longest chain of imports (lazy ones included, type-only ones
    not), ``__main__`` left out as ``python -m``'s shim. The flat package had 16."""
    floors = _floors(_graph())
    floors.pop(f"{PACKAGE.name}.__main__", None)
    top = max(floors.values())
    chain = sorted(floors.items(), key=lambda kv: kv[1])
    assert top <= MAX_FLOORS, chain[-MAX_FLOORS - 2 :]


def test_the_rooms_are_folders() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert set(ROOMS) - {BASE} <= folders
    assert len(folders & set(ROOMS)) >= 6


def test_no_module_is_over_700_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700
    }
    assert long == {}
