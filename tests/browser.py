"""Debian's headless Chromium for the tests that drive a page like a person (the console, Open
WebUI): Playwright cannot download its own browsers here, so Selenium drives the packaged one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def require_browser(what: str) -> None:
    """Skip without Chromium and its driver; fail instead under CI (`.ci/run` installs them)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        reason = f"{', '.join(missing)} missing (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{what} need a browser in CI: {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def headless_chrome(page_load_timeout_s: float) -> Iterator[Any]:
    """A headless Chromium window of 1400x1000, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(page_load_timeout_s)
    try:
        yield driver
    finally:
        driver.quit()
