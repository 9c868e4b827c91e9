"""The console's screenshots in docs/images, taken by headless Chromium (Playwright).

    python -m examples.console_screenshot --dsn postgresql://postgres@localhost/postgres \
        --out docs/images

Creates two throw-away databases on the server of ``--dsn`` (a shop and a billing service),
fills them with a realistic mix (a backlog, retries, dead letters with a hostile payload, a
paused type, a held limit key, a blocked ordering key, an hour of deliveries), serves the console
over both in process with actions on, and photographs the overview, the dead letters, a
message, a replay confirmation, the flow page and the ready messages of a typo'd event type at
1,400 px.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

from outbox_celery import Event, enqueue_many, ops
from outbox_celery.db.migrations import migrate
from outbox_celery.testing import temporary_database
from outbox_celery.web import Database, create_app

TOKEN = "screenshot"


def _seed(dsn: str, *, billing: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, "outbox")
        if billing:
            with conn.transaction():
                enqueue_many(
                    conn, [Event("invoice.paid", {"n": i}, "invoice", f"INV-{i}") for i in range(40)]
                )
            conn.execute("UPDATE outbox SET status = 'done', done_at = now() WHERE id <= 30")
            return
        with conn.transaction():
            enqueue_many(
                conn, [Event("order.created", {"order": i}, "order", f"2026-{i:05d}") for i in range(120)]
            )
            enqueue_many(
                conn,
                [
                    Event(
                        "webhook.partner",
                        {"order": i},
                        "order",
                        f"2026-{i:05d}",
                        limit_key=f"partner-{i % 3}",
                    )
                    for i in range(60)
                ],
            )
            enqueue_many(
                conn,
                [
                    Event("order.status_changed", {"seq": i}, "order", "2026-00042", ordered=True)
                    for i in range(4)
                ],
            )
            enqueue_many(
                conn,
                [
                    Event(
                        "mail.sent",
                        {
                            "to": "a@example.com",
                            "order": uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427"),
                            "total": Decimal("129.90"),
                            "body": "<script>alert('x')</script>",
                        },
                        "mail",
                        "m1",
                    )
                ],
            )
            # A typo'd event type: no app claims it, so it waits, flagged in red.
            enqueue_many(conn, [Event("order.creatd", {"order": 7}, "order", "2026-00007")])
        # An hour of deliveries, with latencies that move.
        conn.execute(
            "UPDATE outbox SET status = 'done', created_at = now() - make_interval(secs => id * 20 + 5),"
            " done_at = now() - make_interval(secs => id * 20) + make_interval(secs => (id % 7) * 0.3)"
            " WHERE event_type = 'order.created' AND id <= 100"
        )
        conn.execute(
            "UPDATE outbox SET status = 'dead', attempts = 12,"
            " last_error = 'PermanentError: HTTP 422 from https://partner.example.com: unknown customer'"
            " WHERE event_type = 'webhook.partner' AND id % 10 = 0"
        )
        conn.execute(
            "UPDATE outbox SET status = 'dead', attempts = 1,"
            " last_error = 'mailer refused <script>alert(1)</script>'"
            " WHERE event_type = 'mail.sent'"
        )
        head = conn.execute("SELECT min(id) FROM outbox WHERE event_type = 'order.status_changed'").fetchone()
        assert head is not None
        conn.execute(
            "UPDATE outbox SET status = 'dead', attempts = 5, last_error = 'RetryableError: timeout'"
            " WHERE id = %s",
            [head[0]],
        )
        conn.execute(
            "UPDATE outbox SET attempts = 2, available_at = now() + interval '40 seconds'"
            " WHERE event_type = 'order.created' AND id > 110"
        )
        conn.execute(
            "UPDATE outbox SET available_at = now() - interval '4 minutes' WHERE event_type = 'order.creatd'"
        )
        conn.execute(
            "UPDATE outbox SET status = 'processing', lease_version = 1,"
            " lease_until = now() + interval '30 s'"
            " WHERE event_type = 'webhook.partner' AND status = 'pending' AND id % 10 IN (1, 2)"
        )
        ops.pause(conn, "outbox", "mail.sent")
        ops.pause(conn, "outbox", "webhook.partner", limit_key="partner-2")


def main(argv: list[str] | None = None) -> int:
    """Seed, serve and photograph; the PNGs go to ``--out``."""
    import uvicorn
    from playwright.sync_api import sync_playwright

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", required=True, help="a server to create the two databases on")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    browser_path = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)), None)
    with (
        temporary_database(args.dsn, prefix="shop") as shop,
        temporary_database(args.dsn, prefix="billing") as bill,
    ):
        _seed(shop, billing=False)
        _seed(bill, billing=True)
        app = create_app(
            [Database("shop", shop), Database("billing", bill)],
            actions=True,
            token=TOKEN,
            flower_url="http://127.0.0.1:5555",
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        with psycopg.connect(shop) as conn:
            row = conn.execute("SELECT min(id) FROM outbox WHERE event_type = 'mail.sent'").fetchone()
        assert row is not None
        shots: dict[str, Any] = {
            "console-overview.png": "/",
            "console-dead.png": "/db/shop/dead",
            "console-message.png": f"/db/shop/message/{row[0]}",
            "console-confirm.png": "/db/shop/dead/confirm?action=requeue&error=422",
            "console-flow.png": "/db/shop/flow",
            "console-ready.png": "/db/shop/messages?state=ready&event_type=order.creatd",
        }
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/login")
            page.fill("input[name=token]", TOKEN)
            page.click("button[type=submit]")
            for name, url in shots.items():
                page.goto(base + url)
                page.screenshot(path=str(args.out / name), full_page=True)
                print(args.out / name)
            browser.close()
        server.should_exit = True
        thread.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
