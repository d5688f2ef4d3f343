"""A real headless chromium for the console's browser tests, driven by Playwright's Python package.

The browser is Debian's ``chromium`` package (``make test`` installs it: ``apt-get install -y chromium``),
never a download by ``playwright install``. Screenshots go to ``.artifacts/console/`` (gitignored).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateways import REPO

CHROMIUM = os.environ.get("GATEWAY_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / ".artifacts" / "console"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: `make test` installs it (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser context (no shared storage) and page; script errors and console errors (a CSP
    violation is one) are collected in ``page.console_errors``. An HTTP error status the page handles (a
    wrong token, an unknown model) is not an error of the page and is left out."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on(
        "console",
        lambda message: (
            errors.append(message.text)
            if message.type == "error" and not message.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.console_errors = errors
    yield page
    context.close()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
