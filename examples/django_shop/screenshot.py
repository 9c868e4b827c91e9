"""Screenshots of the outbox admin in headless Chromium (the pages seen, not only requested).

Run it against the running example (see README.md, "Fix it in the admin")::

    python screenshot.py --url http://127.0.0.1:8000 --user admin --password change-me --out ../../docs/images

It logs in over HTTP, saves each admin page with a ``<base href>`` pointing at the server (so
styles load from it) and has ``chromium --headless --screenshot`` render it: the list of live
messages with its filters and summary, the dead messages, and the detail page of a dead one.
Chromium's command-line mode sends no cookies, hence the saved pages.
"""

from __future__ import annotations

import argparse
import http.cookiejar
import re
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

CHANGELIST = "/admin/outbox_celery/outboxmessage/"


class Session:
    """A logged-in admin session."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=30) as r:
            return str(r.read().decode())

    def login(self, user: str, password: str) -> None:
        self.get("/admin/login/")
        csrf = next(c.value for c in self.jar if c.name == "csrftoken")
        body = urllib.parse.urlencode(
            {"username": user, "password": password, "next": "/admin/", "csrfmiddlewaretoken": csrf}
        ).encode()
        request = urllib.request.Request(
            self.base + "/admin/login/", data=body, headers={"Referer": self.base + "/admin/login/"}
        )
        with self.opener.open(request, timeout=30) as r:
            if "/admin/login/" in r.geturl():
                raise SystemExit("login failed: check --user and --password")


def shoot(session: Session, path: str, png: Path, size: str, browser: str, tmp: Path) -> None:
    html = session.get(path).replace("<head>", f'<head><base href="{session.base}{path}">', 1)
    page = tmp / (png.stem + ".html")
    page.write_text(html)
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={png}",
            f"--window-size={size}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"{png} <- {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", required=True)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--list-size", default="1400,640", help="window size of the list, WIDTH,HEIGHT")
    parser.add_argument("--detail-size", default="1280,1180", help="window size of the detail page")
    parser.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    session = Session(args.url)
    session.login(args.user, args.password)
    args.out.mkdir(parents=True, exist_ok=True)
    dead = re.findall(r'name="_selected_action" value="(\d+)"', session.get(CHANGELIST + "?status=dead"))
    if not dead:
        raise SystemExit("no dead message to show: follow the README first")
    with tempfile.TemporaryDirectory() as tmp:
        shoot(
            session, CHANGELIST, args.out / "django-admin-list.png", args.list_size, args.browser, Path(tmp)
        )
        shoot(
            session,
            f"{CHANGELIST}{dead[0]}/change/",
            args.out / "django-admin-dead.png",
            args.detail_size,
            args.browser,
            Path(tmp),
        )


if __name__ == "__main__":
    main()
