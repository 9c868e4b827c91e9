"""The console's routes, its authentication and CSRF checks, and its database pools.

Reads are bounded (:mod:`outbox_celery.console`); actions reuse :mod:`outbox_celery.ops`.
Every refusal happens before any database call, so a refused request changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import anyio
import jinja2
import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from ..dsn import invalid_dsn, password
from ..errors import AdminError, first_line
from ..flow import Limit
from ..ops import console, durations
from ..ops import dead as letters
from ..ops import flow as flows
from ..table import TableName
from . import display

__all__ = ["Database", "create_app"]

logger = logging.getLogger(__name__)

CSRF_COOKIE = "outbox_console_csrf"
AUTH_COOKIE = "outbox_console_auth"
#: How often the overview's live part reloads itself (seconds).
REFRESH_SECONDS = 5
_TEMPLATES = Path(__file__).parent / "templates"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass(frozen=True)
class Database:
    """One outbox table the console shows: a name for the pages, a DSN that never reaches them.

    :ivar name: shown on the pages and used in their URLs (letters, digits, ``_ . -``).
    :ivar dsn: a libpq connection string; kept out of ``repr`` and of every page and error.
    :ivar table: the outbox table (``schema.table`` allowed).
    :ivar limits: the declared limits per event type, when the app is known (``-A``).
    :ivar handlers: the routes the app has a handler for, when it is known (``-A``): a type with
        pending messages and none is flagged unroutable. ``None``: the console judges by what
        the database knows (subscriptions, ready messages nobody claims).
    :ivar claim_interval: the app's ``claim_interval`` (``None``: the default configuration's);
        a ready message unclaimed past it and a margin is flagged.
    """

    name: str
    dsn: str = field(repr=False)
    table: str = "outbox"
    limits: Mapping[str, Limit] = field(default_factory=dict, repr=False)
    handlers: frozenset[str] | None = field(default=None, repr=False)
    claim_interval: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.name or not set(self.name) <= _NAME_CHARS:
            raise ValueError(f"invalid console database name {self.name!r}: use letters, digits, _ . -")
        TableName.parse(self.table)
        # Parsed here, before anything else reads it: libpq's parse error quotes the part it
        # stumbled on, which may be the password.
        try:
            conninfo_to_dict(self.dsn)
        except psycopg.ProgrammingError as exc:
            raise ValueError(f"console database {self.name!r}: {invalid_dsn(self.dsn, exc)}") from None


class _RefusedError(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


class _Pools:
    """One small connection pool per database, opened on first use."""

    def __init__(self, databases: Sequence[Database]) -> None:
        self._databases = {d.name: d for d in databases}
        self._pools: dict[str, ConnectionPool[Any]] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> ConnectionPool[Any]:
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                db = self._databases[name]
                pool = ConnectionPool(
                    db.dsn,
                    min_size=1,
                    max_size=4,
                    timeout=3,
                    name=f"outbox-console-{name}",
                    kwargs={
                        "autocommit": True,
                        "application_name": "outbox-celery-web",
                        "connect_timeout": 5,
                    },
                    open=True,
                )
                self._pools[name] = pool
            return pool

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_TEMPLATES),
        # Payloads, keys, event types and errors are untrusted input: everything is escaped.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["duration"] = durations.format_duration
    env.filters["ms"] = lambda s: "-" if s is None else f"{s * 1000:,.0f} ms"
    env.filters["short_payload"] = display.short_payload
    return env


def create_app(
    databases: Sequence[Database],
    *,
    actions: bool = False,
    token: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    authorize: Callable[[Request], bool] | None = None,
    flower_url: str | None = None,
    cap: int = console.DEFAULT_CAP,
    minute_cap: int = console.DEFAULT_MINUTE_CAP,
    secret: bytes | None = None,
) -> Starlette:
    """The console as an ASGI app over ``databases`` (shown side by side).

    :param actions: allow replay, skip, pause and resume; read-only otherwise.
    :param token: a bearer token every request must carry (``Authorization: Bearer`` or the
        cookie the login form sets).
    :param basic_auth: ``(user, password)`` every request must carry (HTTP basic auth).
    :param authorize: the host application's check (mounted): called with each request, it
        returns whether the request may see and act on the console.
    :param flower_url: Flower's base URL; a message's Celery task ids link to it.
    :param cap: index entries a count reads at most per status (``10,000+`` beyond).
    :param minute_cap: done rows the hour's chart reads at most per minute.
    :param secret: the key of the CSRF and login cookies (random per process by default).

    Actions need one of ``token``, ``basic_auth`` or ``authorize`` (:class:`ValueError`
    otherwise); every POST needs the page's CSRF token.
    """
    if not databases:
        raise ValueError("the console needs at least one database")
    names = [d.name for d in databases]
    if len(set(names)) != len(names):
        raise ValueError(f"console database names must be distinct, got {names}")
    if actions and token is None and basic_auth is None and authorize is None:
        raise ValueError("actions need authentication: give token=, basic_auth= or authorize=")
    access = _Access(secret or secrets.token_bytes(32), actions, token, basic_auth, authorize)
    pages = _Pages(databases, access, flower_url, cap, minute_cap)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        pages.pools.close()

    app = Starlette(routes=pages.routes(), lifespan=lifespan)
    app.state.pools = pages.pools
    return app


class _Access:
    """Who may see and act: the host's check, basic auth, the token, and every POST's CSRF."""

    def __init__(
        self,
        key: bytes,
        actions: bool,
        token: str | None,
        basic_auth: tuple[str, str] | None,
        authorize: Callable[[Request], bool] | None,
    ) -> None:
        self._key = key
        self.actions = actions
        self.token = token
        self._basic_auth = basic_auth
        self._authorize = authorize

    def sign(self, value: str) -> str:
        return hmac.new(self._key, value.encode(), hashlib.sha256).hexdigest()

    def _basic_ok(self, header: str) -> bool:
        assert self._basic_auth is not None
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, pw = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        ok_user = hmac.compare_digest(user.encode(), self._basic_auth[0].encode())
        ok_pw = hmac.compare_digest(pw.encode(), self._basic_auth[1].encode())
        return ok_user and ok_pw

    def authenticated(self, request: Request) -> bool:
        if self._authorize is not None and not self._authorize(request):
            return False
        header = request.headers.get("authorization", "")
        if self._basic_auth is not None and not self._basic_ok(header):
            return False
        if self.token is not None:
            scheme, _, value = header.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), self.token.encode()):
                return True
            cookie = request.cookies.get(AUTH_COOKIE, "")
            return hmac.compare_digest(cookie.encode(), self.sign("auth:" + self.token).encode())
        return True

    def refuse_unauthenticated(self, request: Request) -> None:
        if self.authenticated(request):
            return
        if self._basic_auth is not None:
            raise _RefusedError(
                401, "authentication required", {"WWW-Authenticate": 'Basic realm="outbox console"'}
            )
        raise _RefusedError(401, "authentication required: sign in with the console's token")

    @staticmethod
    def csrf_cookie(request: Request) -> str:
        value = request.cookies.get(CSRF_COOKIE, "")
        return value if len(value) == 32 and all(c in "0123456789abcdef" for c in value) else ""

    async def check_post(self, request: Request, *, login: bool = False) -> dict[str, str]:
        """Every refusal of a POST, before anything runs: actions off, no auth, bad CSRF."""
        if not login and not self.actions:
            raise _RefusedError(
                403, "actions are disabled: this console is read-only (start it with --actions)"
            )
        if not login:
            self.refuse_unauthenticated(request)
        origin = request.headers.get("origin")
        # The host only: behind a proxy that ends TLS the scheme seen here may be http.
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
            raise _RefusedError(403, "cross-origin request refused")
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        cookie = self.csrf_cookie(request)
        given = form.get("csrf", "")
        if not cookie or not hmac.compare_digest(given.encode(), self.sign("csrf:" + cookie).encode()):
            raise _RefusedError(403, "invalid or missing CSRF token: reload the page and try again")
        return form


class _Pages:
    """The console's pages over its databases: each reads through :mod:`console`, acts through
    :mod:`outbox_celery.ops`, and turns every refusal into an error page."""

    def __init__(
        self,
        databases: Sequence[Database],
        access: _Access,
        flower_url: str | None,
        cap: int,
        minute_cap: int,
    ) -> None:
        self.databases = databases
        self.access = access
        self.cap = cap
        self.minute_cap = minute_cap
        self.env = _environment()
        self.pools = _Pools(databases)
        self.by_name = {d.name: d for d in databases}
        self.secrets_to_hide = [s for s in (password(d.dsn) for d in databases) if s]
        self.flower = flower_url.rstrip("/") if flower_url else None

    def routes(self) -> list[Route]:
        page = self.page
        return [
            Route("/", page(self.overview)),
            Route("/login", page(self.login, public=True), methods=["GET", "POST"]),
            Route("/db/{db}/dead", page(self.dead)),
            Route("/db/{db}/messages", page(self.messages)),
            Route("/db/{db}/dead/confirm", page(self.confirm)),
            Route("/db/{db}/dead/bulk", page(self.bulk), methods=["POST"]),
            Route("/db/{db}/message/{id}", page(self.message)),
            Route("/db/{db}/message/{id}/{action}", page(self.message_action), methods=["POST"]),
            Route("/db/{db}/flow", page(self.flow)),
            Route("/db/{db}/flow/{action}", page(self.flow_action), methods=["POST"]),
        ]

    def scrub(self, text: str) -> str:
        for s in self.secrets_to_hide:
            text = text.replace(s, "***")
        return text

    def database(self, request: Request) -> Database:
        db = self.by_name.get(request.path_params.get("db", ""))
        if db is None:
            raise _RefusedError(404, "no such database")
        return db

    async def run(self, db: Database, fn: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        def call() -> Any:
            with self.pools.get(db.name).connection() as conn:
                return fn(conn)

        try:
            return await run_in_threadpool(call)
        except AdminError as exc:
            raise _RefusedError(409, self.scrub(first_line(exc))) from None
        except Exception as exc:
            # The driver's text may name hosts or users: the page says only which database and
            # what kind of failure; the log keeps the detail, password masked.
            logger.warning("console: database %s: %s", db.name, self.scrub(first_line(exc)))
            raise _RefusedError(503, f"database {db.name!r} is unavailable ({type(exc).__name__})") from None

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> Response:
        cookie = self.access.csrf_cookie(request)
        new_cookie = not cookie
        if new_cookie:
            cookie = secrets.token_hex(16)
        nonce = secrets.token_urlsafe(12)
        root = request.scope.get("root_path", "")
        html = self.env.get_template(template).render(
            request=request,
            root=root,
            databases=self.databases,
            actions=self.access.actions,
            csrf=self.access.sign("csrf:" + cookie),
            nonce=nonce,
            flower=self.flower,
            refresh=REFRESH_SECONDS,
            login=self.access.token is not None,
            **context,
        )
        response = HTMLResponse(html, status_code=status)
        response.headers["Content-Security-Policy"] = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; "
            "base-uri 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        if new_cookie:
            response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict", path=root or "/")
        return response

    def page(
        self, handler: Callable[[Request], Awaitable[Response]], *, public: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                # Every method passes the same check: Starlette answers HEAD on each GET route,
                # and its Content-Length alone would read a page out.
                if not public:
                    self.access.refuse_unauthenticated(request)
                return await handler(request)
            except _RefusedError as exc:
                response = self.render(request, "error.html", status=exc.status, message=exc.message)
                response.headers.update(exc.headers)
                return response

        return wrapped

    # -- pages --------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        # Every database at once (an unavailable one becomes its panel's error).
        panels: list[dict[str, Any]] = [{"db": db, "error": None} for db in self.databases]

        async def fill(panel: dict[str, Any]) -> None:
            try:
                panel.update(await self.read_overview(panel["db"], minutes=True))
            except _RefusedError as exc:
                panel["error"] = exc.message

        async with anyio.create_task_group() as group:
            for p in panels:
                group.start_soon(fill, p)
        for p in panels:
            if p["error"] is None:
                p["chart"] = display.chart(p["minutes"])
                known: Database = p["db"]
                p["flags"] = console.flags(
                    p["overview"], handlers=known.handlers, claim_interval=known.claim_interval
                )
                p["flagged"] = {f.event_type for f in p["flags"]}
        template = "overview_live.html" if request.query_params.get("partial") else "overview.html"
        return self.render(request, template, panels=panels)

    async def read_overview(self, db: Database, *, minutes: bool) -> dict[str, Any]:
        """``{"overview": ..., "minutes": ...}`` of ``db``: the parts of the counts each on its
        own connection of the pool, the holds (and the hour's chart) on a fourth, all at once,
        so the page waits for its slowest read rather than their sum."""
        got: dict[str, Any] = {}
        refused: list[_RefusedError] = []

        async def read(key: str, fn: Callable[[psycopg.Connection[Any]], Any]) -> None:
            try:
                got[key] = await self.run(db, fn)
            except _RefusedError as exc:
                refused.append(exc)

        def part(name: str) -> Callable[[psycopg.Connection[Any]], console.CountPart]:
            return lambda conn: console.count_part(conn, db.table, name, cap=self.cap)

        def beside(conn: psycopg.Connection[Any]) -> tuple[console.Holds, list[console.Minute] | None]:
            held = console.holds(conn, db.table, cap=self.cap)
            return held, console.minutes(conn, db.table, minute_cap=self.minute_cap) if minutes else None

        async with anyio.create_task_group() as group:
            for name in console.COUNT_PARTS:
                group.start_soon(read, name, part(name))
            group.start_soon(read, "beside", beside)
        if refused:
            raise refused[0]
        held, chart = got["beside"]
        parts = [got[name] for name in console.COUNT_PARTS]
        return {"overview": console.assemble(parts, held, cap=self.cap), "minutes": chart}

    async def dead(self, request: Request) -> Response:
        db = self.database(request)
        q = _dead_query(request.query_params)
        try:
            after = max(0, int(request.query_params.get("after", "0")))
        except ValueError:
            raise _RefusedError(400, "invalid page (after)") from None

        found: console.DeadPage = await self.run(
            db, lambda conn: console.dead_page(conn, db.table, q, after=after, limit=50)
        )
        return self.render(
            request,
            "dead.html",
            db=db,
            q=q,
            rows=found.rows,
            count=found.matching,
            upto=found.upto,
            qs=_filter_qs(q),
        )

    async def messages(self, request: Request) -> Response:
        db = self.database(request)
        state = request.query_params.get("state", "")
        if state not in console.STATES:
            raise _RefusedError(400, f"unknown state: one of {', '.join(console.STATES)}")
        event_type = request.query_params.get("event_type", "").strip() or None
        try:
            after = max(0, int(request.query_params.get("after", "0")))
        except ValueError:
            raise _RefusedError(400, "invalid page (after)") from None

        def read(conn: psycopg.Connection[Any]) -> tuple[list[console.StateRow], int]:
            return console.list_state(conn, db.table, state, event_type=event_type, after=after, cap=self.cap)

        rows, matching = await self.run(db, read)
        qs = urlencode({k: v for k, v in (("state", state), ("event_type", event_type)) if v})
        return self.render(
            request,
            "messages.html",
            db=db,
            state=state,
            event_type=event_type,
            rows=rows,
            matching=matching,
            cap=self.cap,
            qs=qs,
        )

    async def confirm(self, request: Request) -> Response:
        db = self.database(request)
        action = request.query_params.get("action", "")
        if action not in ("requeue", "skip"):
            raise _RefusedError(400, "unknown action")
        q = _dead_query(request.query_params)
        count, upto = await self.run(db, lambda conn: console.count_dead(conn, db.table, q))
        return self.render(
            request, "confirm.html", db=db, q=q, action=action, count=count, upto=upto, qs=_filter_qs(q)
        )

    async def bulk(self, request: Request) -> Response:
        db = self.database(request)
        form = await self.access.check_post(request)
        action = form.get("action", "")
        if action not in ("requeue", "skip"):
            raise _RefusedError(400, "unknown action")
        q = _dead_query(form, upto=True)
        reason = form.get("reason", "").strip() or f"{action} from the console"
        result = await self.run(
            db, lambda conn: console.bulk_dead(conn, db.table, q, action=action, reason=reason)
        )
        return self.render(request, "done.html", db=db, action=action, result=result, qs=_filter_qs(q))

    async def message(self, request: Request) -> Response:
        db = self.database(request)
        outbox_id = _positive(request.path_params["id"])
        row = await self.run(db, lambda conn: letters.get_message(conn, db.table, outbox_id))
        if row is None:
            raise _RefusedError(404, f"no message {outbox_id}")
        tasks = console.task_ids(db.table, outbox_id, int(row["lease_version"]))
        skipped = letters.was_skipped(row["status"], row["last_error"])
        heading, now = display.error_heading(
            row["status"], int(row["attempts"]), row["last_error"], skipped=skipped
        )
        return self.render(
            request,
            "message.html",
            db=db,
            m=row,
            payload=display.payload(row["payload"]),
            tasks=tasks,
            skipped=skipped,
            error_heading=heading,
            error_now=now,
            errors=display.error_history(row["last_error"]),
            attempts=letters.failed_attempts(row["errors"]),
        )

    async def message_action(self, request: Request) -> Response:
        db = self.database(request)
        form = await self.access.check_post(request)
        outbox_id = _positive(request.path_params["id"])
        action = request.path_params["action"]
        reason = form.get("reason", "").strip() or f"{action} from the console"
        if action == "requeue":
            await self.run(db, lambda conn: letters.requeue(conn, db.table, [outbox_id], reason=reason))
        elif action == "skip":
            await self.run(db, lambda conn: letters.skip(conn, db.table, [outbox_id], reason=reason))
        else:
            raise _RefusedError(404, "unknown action")
        return RedirectResponse(f"{request.scope.get('root_path', '')}/db/{db.name}/message/{outbox_id}", 303)

    async def flow(self, request: Request) -> Response:
        db = self.database(request)

        ov: console.Overview = (await self.read_overview(db, minutes=False))["overview"]
        types = sorted(
            {e.event_type for e in ov.event_types} | {p.event_type for p in ov.paused} | set(db.limits)
        )
        use = {e.event_type: e.in_flight for e in ov.event_types}
        held = {p.event_type: p for p in ov.paused}
        return self.render(
            request, "flow.html", db=db, ov=ov, types=types, use=use, held=held, limits=db.limits
        )

    async def flow_action(self, request: Request) -> Response:
        db = self.database(request)
        form = await self.access.check_post(request)
        action = request.path_params["action"]
        event_type = form.get("event_type", "").strip()
        limit_key = form.get("limit_key", "").strip() or None
        if action == "pause":
            await self.run(db, lambda conn: flows.pause(conn, db.table, event_type, limit_key=limit_key))
        elif action == "resume":
            await self.run(db, lambda conn: flows.resume(conn, db.table, event_type, limit_key=limit_key))
        else:
            raise _RefusedError(404, "unknown action")
        return RedirectResponse(f"{request.scope.get('root_path', '')}/db/{db.name}/flow", 303)

    async def login(self, request: Request) -> Response:
        token = self.access.token
        if token is None:
            raise _RefusedError(404, "this console has no token sign-in")
        if request.method == "GET":
            return self.render(request, "login.html")
        form = await self.access.check_post(request, login=True)
        if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
            raise _RefusedError(401, "wrong token")
        root = request.scope.get("root_path", "")
        response = RedirectResponse(f"{root}/", 303)
        response.set_cookie(
            AUTH_COOKIE, self.access.sign("auth:" + token), httponly=True, samesite="strict", path=root or "/"
        )
        return response


def _dead_query(params: Mapping[str, str], *, upto: bool = False) -> console.DeadQuery:
    def text(name: str) -> str | None:
        value = params.get(name, "").strip()
        if "\x00" in value:
            raise _RefusedError(400, f"invalid {name} filter")
        return value or None

    bound = None
    if upto:
        try:
            bound = int(params.get("upto", ""))
        except ValueError:
            raise _RefusedError(400, "a bulk action needs the count it confirmed (upto)") from None
    return console.DeadQuery(
        event_type=text("event_type"),
        key=text("key"),
        error=text("error"),
        payload=text("payload"),
        upto=bound,
    )


def _filter_qs(q: console.DeadQuery) -> str:
    pairs = {"event_type": q.event_type, "key": q.key, "error": q.error, "payload": q.payload}
    return urlencode({k: v for k, v in pairs.items() if v})


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _RefusedError(404, "no such message") from None
    if value < 1:
        raise _RefusedError(404, "no such message")
    return value
