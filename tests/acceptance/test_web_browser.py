"""The operator console in a real browser (Chromium through Playwright) with a real worker.

The console runs in this process (uvicorn on a free port, actions on, a token); a Celery worker
delivers what the page replays or resumes. Skips where Chromium or Playwright is missing.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from acceptance.conftest import DEFAULT_EVENT, Harness, HarnessFactory
from outbox_celery import Event, enqueue_many, ops
from outbox_celery.db.migrations import migrate
from outbox_celery.web import Database, create_app

pytestmark = pytest.mark.slow

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
TOKEN = "browser-test-token"
SCRIPT = "<script>window.pwned = 1</script>"

try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # pragma: no cover - depends on the installation
    sync_playwright = None  # type: ignore[assignment]

if BROWSER is None or sync_playwright is None:
    pytestmark = [
        pytest.mark.slow,
        pytest.mark.skip(
            reason="Chromium (apt-get install chromium) or Playwright (the dev extra) is not "
            "installed: the console cannot be driven in a real browser here"
        ),
    ]


@pytest.fixture
def harness(redis_url: str, harness_factory: HarnessFactory) -> Harness:
    """Redis only: what the console changes lives in PostgreSQL."""
    return harness_factory(redis_url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def console(harness: Harness) -> Iterator[str]:
    """The console over the harness's table and a second table (another service's outbox)."""
    import uvicorn

    harness.conn.execute("CREATE SCHEMA IF NOT EXISTS billing")
    migrate(harness.conn, "billing.outbox")
    with harness.conn.transaction():
        enqueue_many(harness.conn, [Event("invoice.paid", {"n": 1}, "invoice", "1")], table="billing.outbox")
    dbs = [Database("shop", harness.dsn, harness.table), Database("billing", harness.dsn, "billing.outbox")]
    app = create_app(dbs, actions=True, token=TOKEN)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the console did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def page(console: str) -> Iterator[Page]:
    assert sync_playwright is not None and BROWSER is not None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which(BROWSER), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{console}/login")
            page.fill("input[name=token]", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{console}/")
            yield page
        finally:
            browser.close()


def _kill(harness: Harness, ids: list[int], error: str) -> None:
    harness.conn.execute(
        f"UPDATE {harness.table} SET status = 'dead', attempts = 5, last_error = %s WHERE id = ANY(%s)",
        [error, ids],
    )


def _status(harness: Harness) -> dict[int, str]:
    return {int(r["id"]): str(r["status"]) for r in harness.rows()}


def test_replay_one_and_by_filter_from_the_page_delivers_exactly_those_and_scripts_stay_inert(
    harness: Harness, console: str, page: Page
) -> None:
    [hostile] = harness.enqueue(1, payload={"note": SCRIPT})
    partner_a = harness.enqueue(3, payload={"partner": "partner-a"})
    partner_b = harness.enqueue(2, payload={"partner": "partner-b"})
    _kill(harness, [hostile], f"mailer said {SCRIPT}")
    _kill(harness, partner_a + partner_b, "HTTP 503")
    harness.configure(routes={DEFAULT_EVENT: None})
    harness.worker(concurrency=2)

    # Two databases side by side on the overview.
    page.goto(f"{console}/")
    assert page.locator("section.database").evaluate_all("s => s.map(e => e.dataset.db)") == [
        "shop",
        "billing",
    ]
    assert "invoice.paid" in page.locator("section[data-db=billing]").inner_text()

    # The hostile message: its payload and error are shown as text and never run.
    page.goto(f"{console}/db/shop/message/{hostile}")
    assert SCRIPT in page.locator("#payload").inner_text()
    assert SCRIPT in page.locator("#last-error").inner_text()
    assert page.evaluate("window.pwned") is None
    page.click("#replay")
    harness.wait(lambda: _status(harness)[hostile] == "done", what="the replayed message delivered")

    # Replay by filter: the count first, then a confirmation, then exactly the matching rows.
    page.goto(f"{console}/db/shop/dead?payload=partner-a")
    assert "3 dead message(s) match" in page.locator("#count").inner_text()
    page.click("#requeue-all")
    assert page.locator("#confirm-count strong").inner_text() == "3"
    page.click("#confirm")
    assert page.locator("#result strong").inner_text() == "3"
    harness.wait(
        lambda: all(_status(harness)[i] == "done" for i in partner_a), what="the filter's rows delivered"
    )
    time.sleep(1.0)
    assert [_status(harness)[i] for i in partner_b] == ["dead", "dead"]


def test_pause_and_resume_from_the_page_hold_and_release_delivery(
    harness: Harness, console: str, page: Page
) -> None:
    harness.configure(routes={DEFAULT_EVENT: None})
    harness.worker(concurrency=2)
    page.goto(f"{console}/db/shop/flow")
    # Refused: a POST from the signed-in page without the form's CSRF token, and any request
    # from a browser that has not signed in. Nothing changes.
    forged = page.evaluate(
        """async (t) => (await fetch("/db/shop/flow/pause", {method: "POST",
             headers: {"Content-Type": "application/x-www-form-urlencoded"},
             body: "event_type=" + encodeURIComponent(t)})).status""",
        DEFAULT_EVENT,
    )
    assert forged == 403
    stranger = page.context.browser.new_context() if page.context.browser else None
    assert stranger is not None
    assert stranger.new_page().goto(f"{console}/db/shop/flow").status == 401
    stranger.close()
    assert ops.flow_states(harness.conn, harness.table) == []
    # The page lists a type while it has unfinished rows (or a hold): one due in an hour keeps
    # it there after the resume, however soon the worker then finishes the three held ones.
    with harness.conn.transaction():
        enqueue_many(harness.conn, [Event(DEFAULT_EVENT, {}, "a", "later", delay=3600)], table=harness.table)

    page.fill("input[name=event_type]", DEFAULT_EVENT)
    page.click("#pause-form")
    assert "paused" in page.locator(f"tr[data-type='{DEFAULT_EVENT}'] .state").inner_text()
    held = harness.enqueue(3)
    time.sleep(3.0)  # several claim rounds (push wakes the listener at once)
    assert [_status(harness)[i] for i in held] == ["pending"] * 3

    page.click(f"tr[data-type='{DEFAULT_EVENT}'] button.resume")
    assert "flowing" in page.locator(f"tr[data-type='{DEFAULT_EVENT}'] .state").inner_text()
    harness.wait_finished(3)
