"""The browser the dashboard tests drive: Debian's headless Chromium through Playwright for Python."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright

SCREENSHOTS = Path(__file__).resolve().parents[2] / ".weir" / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}
_CSRF = re.compile(r'name="_csrf_token" value="([^"]+)"')


def chromium_path() -> str:
    """``WEIR_CHROMIUM``, else Debian's ``chromium`` on the PATH; a clear failure when there is none."""
    path = os.environ.get("WEIR_CHROMIUM") or shutil.which("chromium")
    if not path or not Path(path).exists():
        pytest.fail(
            "The dashboard tests need headless Chromium: install Debian's package (apt-get install chromium, "
            "or `make browser`) or set WEIR_CHROMIUM to its executable."
        )
    return path


def launch(playwright: Playwright) -> Browser:
    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses to run as root
    return playwright.chromium.launch(executable_path=chromium_path(), args=args)


def screenshot(page: Page, name: str) -> Path:
    """The page as it looks now, at the viewport's size, in ``.weir/screenshots/NAME.png``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def sign_in(page: Page, base_url: str, token: str) -> None:
    page.goto(f"{base_url}/admin/login")
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}/admin")


def csrf_token(html: str) -> str:
    match = _CSRF.search(html)
    assert match, f"no CSRF field in the page:\n{html[:2000]}"
    return match.group(1)


@contextmanager
def signed_in_client(base_url: str, token: str) -> Iterator[httpx.Client]:
    """An HTTP client holding an admin session (signed in through the form, as a browser does)."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        form = client.get("/admin/login")
        response = client.post("/admin/login", data={"token": token, "_csrf_token": csrf_token(form.text)})
        assert response.status_code == 303, response.text
        yield client


def fail_sign_in(base_url: str, headers: dict[str, str]) -> None:
    """One sign-in with a wrong token, sent with ``headers``."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        token = csrf_token(client.get("/admin/login").text)
        wrong = client.post("/admin/login", data={"token": "a-guess", "_csrf_token": token}, headers=headers)
        assert wrong.status_code == 401


def figure(page: Page, name: str) -> str:
    return page.inner_text(f"[data-figure={name}]")


def number(text: str) -> int:
    return int(text.replace(",", ""))
