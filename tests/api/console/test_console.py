"""The web console (`GET /console`) in a real browser: Debian's headless Chromium driven by
selenium, against the real `dss serve` with the real engine (the process-wide `api_server`).

A user signs in with a key, runs two turns and sees two versions; rolls `main` back and branches
from the tree and sees the graph change; continues on the branch and sees the streamed answer;
another user sees none of it; an admin erases a user and verifies the receipt again (0
remnants). The tree view's screenshot is saved to `$DSS_TEST_ARTIFACTS` (else tests/artifacts/).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.api_server import ApiServer, api_server, chat, user_msg
from tests.browser import headless_chrome, require_browser
from tests.paths import ARTIFACTS

pytestmark = [pytest.mark.engine, pytest.mark.slow]

__all__ = ["api_server"]

WAIT_S = 60.0  # a turn on the CPU engine under load, streamed


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    require_browser("the console tests")
    with headless_chrome(page_load_timeout_s=30) as d:
        yield d


# ---------------------------------------------------------------------------------- helpers
def wait(d: Any, cond: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.1).until(cond)
    except Exception:
        raise AssertionError(f"timed out waiting for {what}; console error: {error_text(d)!r}") from None


def by_id(d: Any, id_: str) -> Any:
    from selenium.webdriver.common.by import By

    return d.find_element(By.ID, id_)


def css(d: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(d.find_elements(By.CSS_SELECTOR, selector))


def error_text(d: Any) -> str:
    text: str = d.execute_script(
        "const e = document.getElementById('error'); return e.hidden ? '' : e.textContent;"
    )
    return text


def sign_in(d: Any, server: ApiServer, key: str, hash_: str = "#/sessions") -> None:
    d.get(f"{server.base_url}/console")
    d.execute_script("sessionStorage.clear(); localStorage.clear();")
    d.get(f"{server.base_url}/console")
    wait(d, lambda d: css(d, "#signin-key"), "the sign-in form")
    by_id(d, "signin-key").send_keys(key)
    by_id(d, "signin-submit").click()
    wait(d, lambda d: css(d, "#sessions-table"), "the sessions view")
    if hash_ != "#/sessions":
        d.get(f"{server.base_url}/console{hash_}")


def tree_versions(d: Any) -> list[int]:
    # In the page, in one call: the tree is redrawn after each action (no stale elements).
    found: list[int] = d.execute_script(
        "return [...document.querySelectorAll('#tree-svg .node')].map((g) => Number(g.dataset.version));"
    )
    return sorted(found)


def heads(d: Any) -> dict[str, int]:
    """Branch name -> the version whose node carries its label."""
    found: dict[str, int] = d.execute_script(
        "const out = {};"
        "for (const g of document.querySelectorAll('#tree-svg .node'))"
        "  for (const h of g.querySelectorAll('.head')) out[h.dataset.branch] = Number(g.dataset.version);"
        "return out;"
    )
    return found


def send(d: Any, text: str) -> str:
    """Types a message into the chat box, waits for the streamed answer to finish and the tree to
    show the new version; returns the streamed text."""
    before = tree_versions(d)
    box = by_id(d, "chat-input")
    box.clear()
    box.send_keys(text)
    max_tokens = by_id(d, "chat-max")
    max_tokens.clear()
    max_tokens.send_keys("8")
    by_id(d, "chat-send").click()
    wait(
        d, lambda d: by_id(d, "chat-stream").get_attribute("data-state") == "done", f"the answer to {text!r}"
    )
    wait(d, lambda d: len(tree_versions(d)) == len(before) + 1, "the new version in the tree")
    streamed: str = by_id(d, "chat-stream").text
    return streamed


def select_version(d: Any, n: int) -> None:
    css(d, f'#tree-svg .node[data-version="{n}"] circle')[0].click()
    wait(d, lambda d: by_id(d, "sel-number").text.startswith(f"{n} "), f"version {n} selected")


# ------------------------------------------------------------------------------------ tests
def test_static_files_are_served_with_a_csp(api_server: ApiServer) -> None:
    with httpx.Client(base_url=api_server.base_url, timeout=10) as c:
        page = c.get("/console")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script type="module" src="/console/app.js">' in page.text
        js = c.get("/console/app.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in js.text  # API data is rendered with textContent only
        assert c.get("/console/style.css").status_code == 200
        assert c.get("/console/../app.py").status_code == 404
        assert c.get("/console/secret.txt").status_code == 404


def test_console_tree_actions_isolation_and_erasure(api_server: ApiServer, driver: Any) -> None:
    d = driver
    suffix = uuid.uuid4().hex[:6]
    alice, bob, gone = f"console-alice-{suffix}", f"console-bob-{suffix}", f"console-gone-{suffix}"
    sid = f"trip-{suffix}"

    # A wrong key is a readable message on the sign-in page, not a blank page.
    d.get(f"{api_server.base_url}/console")
    d.execute_script("sessionStorage.clear(); localStorage.clear();")
    d.get(f"{api_server.base_url}/console")
    wait(d, lambda d: css(d, "#signin-key"), "the sign-in form")
    by_id(d, "signin-key").send_keys("dss-not-a-key")
    by_id(d, "signin-submit").click()
    wait(d, lambda d: "401" in error_text(d), "the 401 message")
    assert css(d, "#signin-key")

    # Sign in, create a session, run two turns: two versions on main.
    sign_in(d, api_server, api_server.key(alice))
    by_id(d, "new-session-id").send_keys(sid)
    by_id(d, "new-session-submit").click()
    wait(d, lambda d: css(d, "#chat-input"), "the session view")
    first = send(d, "Name a city in France.")
    assert first.strip()
    send(d, "And one in Spain?")
    assert tree_versions(d) == [1, 2]
    assert heads(d) == {"main": 2}
    messages = [li.text for li in css(d, "#sel-messages li")]
    assert len(messages) == 4 and "Spain" in messages[2]
    kv = by_id(d, "sel-kv").text
    assert "served from cache if continued" in kv

    # Roll main back to v1: the head label moves.
    select_version(d, 1)
    by_id(d, "rollback-submit").click()
    wait(d, lambda d: heads(d) == {"main": 1}, "main's label on v1")
    wait(d, lambda d: by_id(d, "chat-send").text == "Send on main", "v1 selected as main's head")
    # Branch from v2 (left behind by the rollback): a second label.
    select_version(d, 2)
    by_id(d, "branch-name").send_keys("spain")
    by_id(d, "branch-submit").click()
    wait(d, lambda d: heads(d) == {"main": 1, "spain": 2}, "the new branch's label")
    # Continue on the branch: the answer streams in, v3 hangs off v2 and carries the label.
    wait(d, lambda d: by_id(d, "chat-send").text == "Send on spain", "the send button naming the branch")
    streamed = send(d, "Which is bigger?")
    assert streamed.strip()
    assert tree_versions(d) == [1, 2, 3]
    assert heads(d) == {"main": 1, "spain": 3}
    last = css(d, "#sel-messages li")[-1].text
    assert streamed.strip() in last  # the streamed text is the committed answer
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "console-tree.png"
    d.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    docs_shot = os.environ.get("DSS_CONSOLE_DOCS_SCREENSHOT")  # set to refresh docs/console.png
    if docs_shot:
        shutil.copyfile(shot, docs_shot)

    # The sessions list shows the session with its turn count and the KV stored for it.
    d.get(f"{api_server.base_url}/console#/sessions")
    wait(d, lambda d: css(d, f'#sessions-table tr[data-session="{sid}"]'), "the session in the list")
    row = css(d, f'#sessions-table tr[data-session="{sid}"] td')
    assert row[1].text == "3"
    with api_server.client(alice) as c:
        stored = c.get(f"/v1/sessions/{sid}").json()["stored_bytes"]
    assert stored > 0 and row[4].text.endswith("MiB"), row[4].text  # pages of ~5.6 MiB each

    # Another user sees none of it: an empty list, and the session's page is a readable 404.
    sign_in(d, api_server, api_server.key(bob))
    wait(d, lambda d: by_id(d, "sessions-empty").is_displayed(), "bob's empty list")
    assert not css(d, "#sessions-table tbody tr")
    d.get(f"{api_server.base_url}/console#/s/{sid}")
    wait(d, lambda d: "not found" in error_text(d), "the 404 message")
    assert not css(d, "#tree-svg .node")

    # As admin: erase a user with a turn, and verify the receipt again: 0 remnants.
    with api_server.client(gone) as c:
        chat(c, [user_msg("Remember me.")], session_id="s", max_tokens=4)
    sign_in(d, api_server, api_server.admin_key, "#/admin")
    wait(d, lambda d: css(d, "#tiers-table tbody tr"), "the tier table")
    by_id(d, "erase-user").send_keys(gone)
    by_id(d, "erase-submit").click()
    d.switch_to.alert.accept()

    # Its receipt is put on top, verified; the server's listing (older receipts of other tests,
    # not checked in this view) may arrive before or after it.
    def cells(d: Any) -> list[Any]:
        return css(d, "#receipts-table td.verification")

    wait(d, lambda d: cells(d) and "remnants" in cells(d)[0].text, "the receipt")
    cell = cells(d)[0]
    assert cell.text.startswith("0 remnants · chain ok")
    css(d, "#receipts-table button.verify")[0].click()
    wait(d, lambda d: cell.get_attribute("data-checked"), "the fresh verification")
    assert cell.text.startswith("0 remnants · chain ok")
    # A fresh admin view lists it from the server (GET /v1/erasures), newest first.
    receipt_id = css(d, "#receipts-table tbody tr")[0].get_attribute("data-receipt")
    d.execute_script("window.localStorage.removeItem('dss.receipts')")  # not from this browser's memory
    d.refresh()
    wait(d, lambda d: css(d, "#receipts-table tbody tr"), "the listed receipts")
    row = css(d, "#receipts-table tbody tr")[0]
    assert row.get_attribute("data-receipt") == receipt_id
    row.find_element("css selector", "button.verify").click()
    cell = row.find_element("css selector", "td.verification")
    wait(d, lambda d: cell.get_attribute("data-checked"), "the listed receipt's verification")
    assert cell.text.startswith("0 remnants · chain ok")
    wait(d, lambda d: css(d, "#chart-hits-svg polyline"), "the hit-rate chart", timeout=15)

    # Delete the session from the console (as alice).
    sign_in(d, api_server, api_server.key(alice))
    d.get(f"{api_server.base_url}/console#/s/{sid}")
    wait(d, lambda d: css(d, "#tree-svg .node"), "the tree")
    by_id(d, "delete-session").click()
    d.switch_to.alert.accept()
    wait(d, lambda d: by_id(d, "sessions-empty").is_displayed(), "the empty list after delete")
    with api_server.client(alice) as c:
        assert c.get(f"/v1/sessions/{sid}").status_code == 404
