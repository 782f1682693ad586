"""The dashboard (/ui) in a real browser: Debian's chromium (/usr/bin/chromium) driven by Python
Playwright (pinned in pyproject's `ui` extra; never `playwright install`: nothing is downloaded
when the tests run) against a real `atoll up` (tests/conftest.py `atoll_up`). `make test-ui`
installs both and runs these (marker `ui`); `make test` leaves them out.

Each test gets a fresh page that records console errors, uncaught exceptions and failed answers
(4xx/5xx); `page.problems()` lists them. Screenshots go to docs/ui/ (ATOLL_UI_SCREENSHOTS
overrides), which the README shows."""

from __future__ import annotations

import os
import pathlib

import httpx
import pytest

from atoll.testing import chromium

SHOTS = pathlib.Path(
    os.environ.get("ATOLL_UI_SCREENSHOTS") or pathlib.Path(__file__).resolve().parents[2] / "docs" / "ui"
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/ui/" in str(item.fspath):
            item.add_marker(pytest.mark.ui)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def browser():
    if not os.access(chromium.PATH, os.X_OK):
        pytest.skip("the dashboard's tests need Debian's chromium (make test-ui installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium.PATH, args=chromium.ARGS)
        yield b
        b.close()


class Watched:
    """A page and what went wrong in it."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.failed: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on(
            "response",
            lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.request.method} {r.url}"),
        )

    def problems(self) -> list[str]:
        return self.errors + self.failed

    def shot(self, name: str, full_page: bool = False) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full_page)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.ui_failed = rep.failed
    return rep


@pytest.fixture
def watched(browser, request):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    w = Watched(ctx.new_page())
    w.page.set_default_timeout(30_000)
    yield w
    if getattr(request.node, "ui_failed", False):  # what the page showed when it failed
        w.shot("failed-" + request.node.name, full_page=True)
        print("console errors:", w.errors, "failed answers:", w.failed)
    ctx.close()


@pytest.fixture
def phone(browser):
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    w = Watched(ctx.new_page())
    yield w
    ctx.close()


def sign_in(w: Watched, url: str, key: str) -> None:
    w.page.goto(url + "/ui")
    field = w.page.get_by_label("API key")
    field.fill(key)
    field.press("Enter")


@pytest.fixture
def made(atoll_up):
    """Sandboxes made through the API during a test, deleted afterwards: `made(api, **body)`."""
    ids: list[tuple[httpx.Client, str]] = []

    def make(api: httpx.Client, **body) -> str:
        r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
        assert r.status_code == 201, r.text
        ids.append((api, r.json()["id"]))
        return r.json()["id"]

    yield make
    for api, sid in ids:
        api.delete(f"/v1/sandboxes/{sid}")
