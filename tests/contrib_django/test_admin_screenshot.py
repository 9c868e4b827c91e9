"""The admin's message list as a browser shows it: headless Chromium at 1,400 px.

The page is rendered by Django (the test client, a real PostgreSQL behind it) with the admin's
own stylesheets, then laid out and photographed by Chromium: every column, "Available at" and
"Last error" included, must fit the window without a horizontal scroll, and a skipped message
must read as skipped, not as delivered. Skips where Chromium is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from outbox_celery import Event, enqueue_many, ops

WIDTH, HEIGHT = 1400, 900
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
ADMIN_STATIC = Path(django.__file__).parent / "contrib" / "admin" / "static"

# Runs after the page's stylesheets applied: where each column ended up, whether the page scrolls.
MEASURE = """
<script>
window.addEventListener("load", function () { setTimeout(function () {
  var root = document.documentElement, headers = {};
  var list = document.querySelector(".results"), box = list.getBoundingClientRect();
  document.querySelectorAll("#result_list thead th").forEach(function (th) {
    var r = th.getBoundingClientRect();
    headers[th.textContent.trim()] = [Math.round(r.left), Math.round(r.right)];
  });
  var out = document.createElement("pre");
  out.id = "layout";
  out.textContent = JSON.stringify({
    scroll: root.scrollWidth, client: root.clientWidth, headers: headers,
    list: {left: Math.round(box.left), right: Math.round(box.right), scroll: list.scrollWidth,
           client: list.clientWidth}
  });
  document.body.appendChild(out);
}, 0); });
</script>
"""

pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="headless Chromium is not installed (apt-get install chromium): the admin's layout "
    "at 1,400 px cannot be measured or photographed here",
)


def _page(html: str, tmp: Path, name: str) -> Path:
    """The admin's HTML, its static files read from Django's own directory, and the measurement."""
    html = re.sub(r'(href|src)="[^"]*?/?admin/(css|js|img)/', rf'\1="{ADMIN_STATIC.as_uri()}/admin/\2/', html)
    html = html.replace("</body>", MEASURE + "</body>")
    page = tmp / f"{name}.html"
    page.write_text(html, encoding="utf-8")
    return page


def _chromium(*args: str) -> str:
    assert BROWSER is not None
    done = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},{HEIGHT}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


@pytest.fixture
def client(django_db: str) -> Client:
    user = User.objects.create_superuser("ops", "ops@example.com", "pw")
    c = Client()
    c.force_login(user)
    return c


def _messages(dsn: str) -> dict[str, int]:
    """A realistic mix: pending, an ordered dead head blocking two, delivered, skipped."""
    long_error = (
        "PermanentError: HTTP 422 from https://partner.example.com/api/v2/orders: the order "
        "references a customer the partner does not know (customer_id=cus_8c1f2a9e)"
    )
    with psycopg.connect(dsn, autocommit=True) as pg:
        with pg.transaction():
            ids = enqueue_many(
                pg,
                [
                    Event("order.status_changed", {"seq": 1}, "order", "2026-000123", ordered=True),
                    Event("order.status_changed", {"seq": 2}, "order", "2026-000123", ordered=True),
                    Event("order.status_changed", {"seq": 3}, "order", "2026-000123", ordered=True),
                    Event("invoice.sent", {"n": 1}, "invoice", "INV-2026-000042"),
                    Event("customer.updated", {"n": 2}, "customer", "cus_8c1f2a9e"),
                    Event("order.created", {"n": 3}, "order", "2026-000124"),
                ],
            )
        head, _, _, delivered, skipped, pending = ids
        dead = "UPDATE outbox SET status = 'dead', attempts = 12, last_error = %s WHERE id = %s"
        pg.execute(dead, [long_error, head])
        pg.execute("UPDATE outbox SET status = 'done', done_at = now() WHERE id = %s", [delivered])
        ops.skip(pg, "outbox", [skipped], reason="customer merged into another account")
    return {"dead": head, "delivered": delivered, "skipped": skipped, "pending": pending}


def test_the_list_fits_1400_px_and_shows_skipped_messages_as_skipped(
    client: Client, django_db: str, tmp_path: Path
) -> None:
    ids = _messages(django_db)
    response = client.get(reverse("admin:outbox_celery_outboxmessage_changelist") + "?status=all")
    assert response.status_code == 200
    page = _page(response.content.decode(), tmp_path, "outbox-list")

    shot = tmp_path / "outbox-list.png"
    _chromium(f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 10_000, "the screenshot is empty"
    # Laid out as in the screenshot: the deferred admin scripts have run when it is measured.
    dom = _chromium("--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found is not None, dom[-3000:]
    layout: dict[str, Any] = json.loads(found.group(1).replace("&quot;", '"'))
    print(f"screenshot: {shot}\nlayout: {layout}")

    # Neither the page nor the list (Django wraps it in a box that scrolls sideways) scrolls.
    assert layout["scroll"] <= layout["client"], f"the page scrolls sideways at {WIDTH} px: {layout}"
    box = layout["list"]
    assert box["scroll"] <= box["client"], f"the list scrolls sideways at {WIDTH} px: {layout}"
    for column in ("Available at", "Last error"):
        assert column in layout["headers"], layout["headers"]
        left, right = layout["headers"][column]
        assert box["left"] <= left < right <= box["right"], f"{column!r} is outside the list's box: {layout}"

    selected = r'name="_selected_action" value="(\d+)"(.*?)</tr>'
    rows = {int(i): row for i, row in re.findall(selected, dom, re.S)}
    assert ">skipped<" in rows[ids["skipped"]], rows[ids["skipped"]][:2000]
    assert ">done<" in rows[ids["delivered"]] and ">skipped<" not in rows[ids["delivered"]]
