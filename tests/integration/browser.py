"""A real browser for the console tests: Debian's headless Chromium, driven by Playwright.

Without Chromium (the README's test command installs it as root) or without the playwright
package, `require_browser` skips the test and says why.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium")
# Debian's chromium in a closed network: no sandbox (root), no background connections.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 120_000  # conditions are waited for, never timed


def require_browser() -> None:
    """Skip, saying why, where the console cannot be driven (call before starting a server)."""
    if CHROMIUM is None:
        pytest.skip("no `chromium` on PATH: apt-get install chromium (README's test command)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


@contextmanager
def chromium() -> Iterator[Any]:
    """A fresh Chromium profile (so no key is kept from another test)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
            accept_downloads=True,
        )
        yield context
        context.close()


def sign_in_by_keyboard(page: Any, base_url: str, key: str) -> None:
    """Tab to the labelled key field, type, Enter: the form works without a mouse."""
    page.goto(base_url + "/console")
    field = page.get_by_label("API key")
    field.wait_for()
    for _ in range(12):
        if page.evaluate("document.activeElement && document.activeElement.id") == "api-key":
            break
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "api-key"
    page.keyboard.type(key)
    page.keyboard.press("Enter")


def unlabelled(page: Any) -> list[str]:
    """Form controls on the page without a label (an empty list is good)."""
    script = """() => [...document.querySelectorAll('input, select, textarea')]
        .filter(e => e.type !== 'hidden' && !(e.labels && e.labels.length) && !e.ariaLabel)
        .map(e => e.outerHTML)"""
    found: list[str] = page.evaluate(script)
    return found
