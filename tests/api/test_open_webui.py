"""Open WebUI, unmodified (`open-webui` from PyPI, its own environment: deploy/open_webui.py), in
front of the real `dss serve` with the real engine, driven in Debian's headless Chromium like a
person: Alice and Bob sign up and chat; Alice regenerates an answer and edits an earlier message.
Then DSS, read as each end user, holds each person's chats as sessions named by Open WebUI's chat
ids, with the regenerated answer and the edit on branches of their own forked where they happened,
the later turns served from cache (`cached_tokens` in the answers Open WebUI received), and erasing
Alice with the frontend's key leaves Bob's sessions as they were.

A recording proxy between Open WebUI and DSS keeps every request and answer; they are written to
`$DSS_TEST_ARTIFACTS/open_webui_requests.json` (else tests/artifacts/) for whoever tunes session
matching to what Open WebUI really sends. The tiny model answers nonsense: only structure is
asserted. One DSS server and one Open WebUI for the module; Open WebUI's environment is installed
on first use (about a minute and a half), outside the checkout. Deselect with `-m "not frontend"`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.haproxy import ensure_haproxy
from deploy.open_webui import ensure_open_webui, open_webui_env
from deploy.spec import ClusterError
from tests.api.test_clients import CLOCK_PERSONA
from tests.api_server import ApiServer, cached_tokens, free_port, get_server
from tests.browser import headless_chrome, require_browser
from tests.paths import ARTIFACTS, REPO
from tests.recording_proxy import Exchange, RecordingProxy
from tests.router_stubs import running_stubs, served_by, start_router

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.frontend]

START_TIMEOUT_S = 300.0  # Open WebUI's first start runs its ~100 migrations; slower on a busy machine
TURN_TIMEOUT_S = 600.0  # a streamed turn on the CPU engine (minutes on a machine under load)
FRONTEND = "webui"
USER_HEADER = "X-OpenWebUI-User-Id"
CHAT_HEADER = "X-OpenWebUI-Chat-Id"


# ---------------------------------------------------------------------------- DSS as a frontend
@dataclass
class DssFrontend:
    """How Open WebUI reaches DSS (one frontend key, `dss keys create --frontend`) and how the
    test reads DSS as one of its end users (end user U is the DSS user FRONTEND/U)."""

    server: ApiServer
    api_key: str  # Open WebUI's OPENAI_API_KEY
    user_header: str
    chat_header: str
    frontend: str

    def dss_users(self) -> set[str]:
        """The DSS users holding sessions (an admin's `GET /v1/users`)."""
        r = httpx.get(
            f"{self.server.base_url}/v1/users",
            params={"limit": 1000},
            headers=self.server.headers("admin", True),
        )
        assert r.status_code == 200, r.text
        return {u["id"] for u in r.json()["data"]}

    def as_end_user(self, owui_user_id: str) -> httpx.Client:
        headers = {self.user_header: owui_user_id, "Authorization": f"Bearer {self.api_key}"}
        return httpx.Client(base_url=self.server.base_url, headers=headers, timeout=120)

    def erase(self, owui_user_id: str) -> httpx.Response:
        """The end user's erasure, as the frontend asks for it."""
        with self.as_end_user(owui_user_id) as c:
            return c.delete(f"/v1/users/{owui_user_id}")


@pytest.fixture(scope="module")
def dss() -> DssFrontend:
    server = get_server()  # the process-wide server: no engine start of its own
    created = subprocess.run(
        [
            sys.executable, "-m", "api.cli", "keys", "create", "--frontend", FRONTEND,
            "--user-header", USER_HEADER, "--session-header", CHAT_HEADER,
            "--data-dir", str(server.data_dir),
        ],
        cwd=REPO, env=server.env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return DssFrontend(server, created.stdout.strip().splitlines()[-1], USER_HEADER, CHAT_HEADER, FRONTEND)


# ------------------------------------------------------------------------------- Open WebUI
@dataclass
class OpenWebUI:
    base_url: str
    proxy: RecordingProxy
    log_path: Path
    admin: Person | None = None  # the first person signed up (who adds the others)


@pytest.fixture(scope="module")
def open_webui(dss: DssFrontend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenWebUI]:
    require_browser("the Open WebUI test")
    root = tmp_path_factory.mktemp("open-webui")
    began = time.monotonic()
    exe = ensure_open_webui(log=root / "install.log")
    installed_s = time.monotonic() - began
    proxy = RecordingProxy(dss.server.base_url)
    proxy.start()
    models = httpx.get(f"{dss.server.base_url}/v1/models", headers=_auth(dss), timeout=30).json()
    env = open_webui_env(
        dss_url=proxy.base_url,
        api_key=dss.api_key,
        data_dir=root / "data",
        secret_key=secrets.token_hex(16),
        model=models["data"][0]["id"],
        user_header=dss.user_header,
        chat_header=dss.chat_header,
    )
    (root / "data").mkdir()
    port = free_port()
    log_path = root / "open-webui.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, proc, log_path)
        print(f"open-webui: installed in {installed_s:.0f} s, started in {time.monotonic() - began:.0f} s")
        yield OpenWebUI(base_url, proxy, log_path)
    finally:
        _save_requests(proxy)
        _stop_group(proc)
        proxy.stop()


def _auth(dss: DssFrontend) -> dict[str, str]:
    return {"Authorization": f"Bearer {dss.api_key}", dss.user_header: "probe"}


def _wait_healthy(base_url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"open-webui exited during start-up:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"open-webui was not up after {START_TIMEOUT_S} s:\n{_tail(log_path)}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    # SIGTERM first; its server waits for open websockets (the browser's), so then SIGKILL.
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _save_requests(proxy: RecordingProxy) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    record = [
        {
            "method": e.method,
            "path": e.path,
            "headers": {k: ("<redacted>" if k == "authorization" else v) for k, v in e.headers.items()},
            "body": e.json() if e.body else None,
            "status": e.status,
            "answer": e.answer() if e.done and e.path.endswith("/chat/completions") else None,
        }
        for e in proxy
    ]
    (ARTIFACTS / "open_webui_requests.json").write_text(json.dumps(record, indent=1))


# ------------------------------------------------------------------------------ the browser
@pytest.fixture(scope="module")
def driver(open_webui: OpenWebUI) -> Iterator[Any]:
    with headless_chrome(page_load_timeout_s=120) as d:
        yield d


class Person:
    """One person at Open WebUI in the shared browser (one signed in at a time)."""

    def __init__(self, d: Any, owui: OpenWebUI, name: str) -> None:
        self.d, self.owui, self.name = d, owui, name
        self.email = f"{name.lower()}-{uuid.uuid4().hex[:6]}@example.com"
        self.password = secrets.token_urlsafe(12)
        self.user_id = ""  # Open WebUI's, known once signed in
        self.token = ""

    def sign_up_first(self) -> None:
        """The very first visitor: greeted, signs up, and becomes Open WebUI's admin (which
        turns sign-ups off: later people are added by the admin)."""
        d = self._fresh_page("/auth")
        _wait(d, lambda d: _xpath(d, "//button[contains(., 'Get started')]"), "the welcome page")
        _xpath(d, "//button[contains(., 'Get started')]")[0].click()
        _wait(d, lambda d: _css(d, "#name"), "the sign-up form")
        _css(d, "#name")[0].send_keys(self.name)
        self._submit_credentials()
        self.owui.admin = self

    def add(self, other: Person) -> None:
        """Adds `other` as a user, as an admin does (Admin Panel > Users > Add User)."""
        r = httpx.post(
            f"{self.owui.base_url}/api/v1/auths/add",
            headers={"Authorization": f"Bearer {self.token}"},
            json={"name": other.name, "email": other.email, "password": other.password, "role": "user"},
            timeout=60,
        )
        assert r.status_code == 200, r.text

    def sign_in(self) -> None:
        d = self._fresh_page("/auth")
        _wait(d, lambda d: _css(d, "#email"), "the sign-in form")
        self._submit_credentials()

    def _fresh_page(self, path: str) -> Any:
        d = self.d
        d.get(f"{self.owui.base_url}{path}")
        d.execute_script("localStorage.clear(); sessionStorage.clear();")  # whoever was signed in
        d.get(f"{self.owui.base_url}{path}")
        return d

    def _submit_credentials(self) -> None:
        d = self.d
        _css(d, "#email")[0].send_keys(self.email)
        _css(d, "#password")[0].send_keys(self.password)
        _css(d, "button[type=submit]")[0].click()
        _wait(d, lambda d: _css(d, "#chat-input"), f"{self.name}'s chat page")
        self.token = d.execute_script("return localStorage.token")
        me = httpx.get(
            f"{self.owui.base_url}/api/v1/auths/",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )
        assert me.status_code == 200, me.text
        self.user_id = me.json()["id"]
        from selenium.webdriver.common.keys import Keys

        d.find_element("tag name", "body").send_keys(Keys.ESCAPE)  # the admin's "What's new"

    def save_settings(self, **ui: Any) -> None:
        """Saves the person's settings as the Settings dialog does (`ui` fields, e.g. `system`:
        Settings > General > System Prompt, which Open WebUI puts first in every chat's messages
        with its `{{...}}` variables filled on each request); the next page load reads them."""
        r = httpx.post(
            f"{self.owui.base_url}/api/v1/users/user/settings/update",
            headers={"Authorization": f"Bearer {self.token}"},
            json={"ui": ui},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert {k: r.json()["ui"].get(k) for k in ui} == ui, r.json()

    def new_chat(self) -> None:
        self.d.get(f"{self.owui.base_url}/")
        _wait(self.d, lambda d: _css(d, "#chat-input"), "a new chat")

    def send(self, text: str) -> Exchange:
        box = _css(self.d, "#chat-input")[0]  # a contenteditable editor
        box.click()
        box.send_keys(text)
        return self._answered(
            lambda: _css(self.d, "#send-message-button")[0].click(), f"the answer to {text!r}"
        )

    def regenerate_last(self) -> Exchange:
        # The hidden button Open WebUI's own shortcut clicks (the visible one shows on hover).
        return self._answered(
            lambda: self.d.execute_script(
                "[...document.querySelectorAll('.regenerate-response-button')].at(-1).click()"
            ),
            "the regenerated answer",
        )

    def edit_user_message(self, index: int, text: str) -> Exchange:
        d = self.d
        d.execute_script(f"document.querySelectorAll('.edit-user-message-button')[{index}].click()")
        _wait(d, lambda d: _css(d, "textarea[id^='message-edit-']"), "the message editor")
        editor = _css(d, "textarea[id^='message-edit-']")[0]
        editor.clear()
        editor.send_keys(text)
        return self._answered(
            lambda: _css(d, "#confirm-edit-message-button")[0].click(), "the edited turn's answer"
        )

    def chat_id(self) -> str:
        url: str = self.d.current_url
        assert "/c/" in url, url
        return url.rsplit("/c/", 1)[1].split("?")[0]

    def _answered(self, act: Callable[[], None], what: str) -> Exchange:
        """Does `act` and waits for the one chat request it makes to be answered in full, and for
        the page to be ready for the next message."""
        before = len(self.owui.proxy.chat_requests())
        act()
        _wait(self.d, lambda d: len(self.owui.proxy.chat_requests()) > before, what, TURN_TIMEOUT_S)
        _wait(self.d, lambda d: not _generating(d), f"{what} shown")
        done = self.owui.proxy.chat_requests()
        assert len(done) == before + 1, [e.json() for e in done[before:]]
        return done[-1]


def _generating(d: Any) -> bool:
    found: bool = d.execute_script(
        "return !!document.querySelector('#stop-response-button, button[aria-label=\"Stop\"]')"
    )
    return found


def _wait(d: Any, cond: Callable[[Any], Any], what: str, timeout: float = 120.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.2).until(cond)
    except Exception:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "open_webui_timeout.png"
        d.save_screenshot(str(shot))
        text = d.execute_script("return document.body.innerText")[-1500:]
        raise AssertionError(
            f"timed out waiting for {what}; page {d.current_url} (screenshot {shot}):\n{text}"
        ) from None


def _css(d: Any, selector: str) -> list[Any]:
    return list(d.find_elements("css selector", selector))


def _xpath(d: Any, path: str) -> list[Any]:
    return list(d.find_elements("xpath", path))


# ------------------------------------------------------------------------------------ test
def _roles(e: Exchange) -> list[str]:
    return [m["role"] for m in e.json()["messages"]]


def _versions(c: httpx.Client, sid: str) -> dict[int, dict[str, Any]]:
    r = c.get(f"/v1/sessions/{sid}/versions")
    assert r.status_code == 200, r.text
    return {v["number"]: v for v in r.json()["data"]}


def _sessions(c: httpx.Client) -> dict[str, dict[str, Any]]:
    r = c.get("/v1/sessions", params={"limit": 100})
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["data"]}


def test_two_people_chat_regenerate_edit_and_one_is_erased(
    dss: DssFrontend, open_webui: OpenWebUI, driver: Any
) -> None:
    alice, bob = Person(driver, open_webui, "Alice"), Person(driver, open_webui, "Bob")

    # Alice: two turns, then regenerates the second answer and edits her second message.
    alice.sign_up_first()
    t1 = alice.send("Name three colours.")
    chat_a = alice.chat_id()
    t2 = alice.send("And three animals?")
    regen = alice.regenerate_last()
    edit = alice.edit_user_message(1, "And three fruits?")

    # What Open WebUI sends: the whole dialogue each time, the person and the chat in headers.
    for e in (t1, t2, regen, edit):
        assert e.status == 200, e.response_body[-500:]
        assert e.headers[dss.user_header.lower()] == alice.user_id
        assert e.headers[dss.chat_header.lower()] == chat_a
        assert e.json()["stream"] is True
    assert _roles(t1) == ["user"] and _roles(t2) == _roles(regen) == _roles(edit) == [
        "user",
        "assistant",
        "user",
    ]
    assert regen.json()["messages"] == t2.json()["messages"]  # regenerate resends the same dialogue
    assert edit.json()["messages"][:2] == t2.json()["messages"][:2]
    assert edit.json()["messages"][2]["content"] == "And three fruits?"

    # DSS: the chat is a session; the regenerated answer and the edit fork after turn 1, each on
    # a branch of its own, and everything after turn 1 was served from cache.
    answers = {name: e.answer() for name, e in (("t1", t1), ("t2", t2), ("regen", regen), ("edit", edit))}
    assert {a["session_id"] for a in answers.values()} == {chat_a}
    v1 = answers["t1"]["state_version"]
    assert answers["t1"]["parent_version"] is None
    for name in ("t2", "regen", "edit"):
        assert answers[name]["parent_version"] == v1, (name, answers[name])
    assert len({answers[n]["branch"] for n in ("t2", "regen", "edit")}) == 3
    # Every later turn reuses at least turn 1's prompt (its last token is always recomputed). A
    # first turn reuses nothing of the person's own, but may be served a public prefix that
    # another module of the shared server registered, so its own count is not asserted.
    t1_prompt = t1.answer()["usage"]["prompt_tokens"]
    for e in (t2, regen, edit):
        assert cached_tokens(e.answer()) >= t1_prompt - 1, (t1_prompt, e.answer().get("usage"))
    with dss.as_end_user(alice.user_id) as as_alice:
        assert set(_sessions(as_alice)) == {chat_a}
        versions = _versions(as_alice, chat_a)
        assert [versions[n]["parent"] for n in sorted(versions)] == [None, v1, v1, v1]

    # Bob: his own chat, nothing of Alice's.
    alice.add(bob)
    bob.sign_in()
    b1 = bob.send("What is the capital of France?")
    chat_b = bob.chat_id()
    assert b1.headers[dss.user_header.lower()] == bob.user_id != alice.user_id
    assert b1.answer()["session_id"] == chat_b != chat_a
    with dss.as_end_user(bob.user_id) as as_bob:
        assert set(_sessions(as_bob)) == {chat_b}
        bob_before = _versions(as_bob, chat_b)

    # Each person is a DSS user of the frontend's: webui/<Open WebUI user id>.
    assert {f"{FRONTEND}/{alice.user_id}", f"{FRONTEND}/{bob.user_id}"} <= dss.dss_users()

    # Alice asks to be forgotten: the frontend erases her; Bob keeps everything.
    erased = dss.erase(alice.user_id)
    assert erased.status_code == 200, erased.text
    assert erased.json()["verification"]["remnants"] == 0
    with dss.as_end_user(alice.user_id) as as_alice:
        assert _sessions(as_alice) == {}
    held = dss.dss_users()
    assert f"{FRONTEND}/{alice.user_id}" not in held and f"{FRONTEND}/{bob.user_id}" in held
    with dss.as_end_user(bob.user_id) as as_bob:
        assert set(_sessions(as_bob)) == {chat_b}
        assert {n: v["n_tokens"] for n, v in _versions(as_bob, chat_b).items()} == {
            n: v["n_tokens"] for n, v in bob_before.items()
        }


# ------------------------------------------------------------------ lead updates (issue 27)
# Open WebUI's own variables: the time (the browser's, to the second, on every request) and the
# person's name. The time comes first, as people often write such prompts; the bulk after it is the
# history a lead update keeps (without one, only the tokens before the first changed digit are
# shared with the stored version: a long prompt keeps them a small share). The bulk is the
# openai-agents test's persona.
CLOCK_SYSTEM_PROMPT = (
    "{{CURRENT_DATETIME}} is the current date and time. You are talking with {{USER_NAME}}.\n" + CLOCK_PERSONA
)
CLOCK_QUESTIONS = ["Do you bake rye bread?", "And on Sundays?", "Can I order a cake for Friday?"]
PAUSE_S = 2.0  # between turns: the time Open WebUI renders (to the second) moves on
DATETIME = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


def _set_lead_updates(dss: DssFrontend, mode: str | None) -> None:
    """The frontend's lead updates, as an operator sets them (`PATCH /v1/admin/frontends/{name}`:
    its keys follow at once on this server; None: the server's setting)."""
    r = httpx.patch(
        f"{dss.server.base_url}/v1/admin/frontends/{dss.frontend}",
        json={"lead_updates": mode},
        headers=dss.server.headers("admin", True),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["lead_updates"] == mode


def _dss_block(e: Exchange) -> dict[str, Any]:
    """The streamed answer's `dss` block (on its usage chunk)."""
    for line in e.response_body.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and '"dss"' in line:
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("dss") is not None:
                block: dict[str, Any] = chunk["dss"]
                return block
    raise AssertionError(f"no dss block in the answer: {e.response_body[-500:]!r}")


def _clock_chat(person: Person) -> tuple[str, list[Exchange]]:
    """A new chat of a few turns, some seconds apart; its id and the turns' exchanges."""
    person.new_chat()
    turns = []
    for i, question in enumerate(CLOCK_QUESTIONS):
        if i:
            time.sleep(PAUSE_S)
        turns.append(person.send(question))
    return person.chat_id(), turns


def test_a_system_prompt_with_the_time_keeps_the_history_cached_with_lead_updates(
    dss: DssFrontend, open_webui: OpenWebUI, driver: Any
) -> None:
    carol = Person(driver, open_webui, "Carol")
    if open_webui.admin is None:  # this test alone: Carol is the first
        carol.sign_up_first()
    else:
        open_webui.admin.add(carol)
        carol.sign_in()
    # The admin's "What's new" would cover the page on every load (Settings > Interface).
    carol.save_settings(system=CLOCK_SYSTEM_PROMPT, showChangelog=False)
    chats: dict[str, tuple[str, list[Exchange]]] = {}
    try:
        for mode in ("volatile", "off"):
            _set_lead_updates(dss, mode)
            chats[mode] = _clock_chat(carol)
    finally:
        _set_lead_updates(dss, None)

    shares: dict[str, list[float]] = {}
    for mode, (chat, turns) in chats.items():
        answers = [e.answer() for e in turns]
        # Open WebUI sent the whole dialogue under a system prompt it filled anew each turn: the
        # same prompt but for the time, which moved on.
        systems = []
        for k, e in enumerate(turns):
            assert e.status == 200, e.response_body[-500:]
            messages = e.json()["messages"]
            assert [m["role"] for m in messages] == ["system", *["user", "assistant"] * k, "user"]
            system = messages[0]["content"]
            assert "{{" not in system and "You are talking with Carol." in system, system
            assert DATETIME.search(system), system
            assert DATETIME.sub("", system) == DATETIME.sub("", turns[0].json()["messages"][0]["content"])
            systems.append(system)
        assert len(set(systems)) == len(systems), systems
        # Open WebUI sends each earlier answer back with the whitespace around it stripped; DSS
        # takes such an answer as the stored one (`dss.echoed_answers`). Before, a turn after an
        # answer that ended in a newline became a new root (a flaky run of this test).
        for k, e in enumerate(turns[1:], start=1):
            sent = [m["content"] for m in e.json()["messages"] if m["role"] == "assistant"]
            assert sent == [a["content"].strip() for a in answers[:k]], (sent, answers[:k])
            trimmed = sum(a["content"] != a["content"].strip() for a in answers[:k])
            assert _dss_block(e)["echoed_answers"] == trimmed, (_dss_block(e), answers[:k])
        # One session (the chat), each turn extending the one before: with lead updates or not.
        assert {a["session_id"] for a in answers} == {chat}
        for before, a in itertools.pairwise(answers):
            assert a["parent_version"] == before["state_version"], (before, a)
        assert _dss_block(turns[0])["lead_update"] is None  # nothing stored to differ from
        shares[mode] = []
        for before, e, a, system in zip(answers, turns[1:], answers[1:], systems[1:], strict=False):
            history = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"]
            cached = cached_tokens(a)
            shares[mode].append(round(cached / history, 3))
            lead = _dss_block(e)["lead_update"]
            assert lead is not None and lead["kind"] == "volatile", lead
            assert len(lead["changed"]) == 1 and lead["changed"][0]["old"] != lead["changed"][0]["new"], lead
            if mode == "volatile":
                assert lead["served"] is True and lead["reason"] is None, lead
                assert lead["update"] in system and DATETIME.match(lead["update"]), lead  # its line
                assert lead["reused_tokens"] >= 0.9 * history, (lead, history)
                assert cached >= 0.9 * history, (a["usage"], history)
            else:
                assert (lead["served"], lead["reason"]) == (False, "off"), lead
                assert cached < 0.1 * history, (a["usage"], history)
    print("cached share of the history per later turn:", shares)


# ---------------------------------------------------------------------- through the router
_NOT_FORWARDED = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def test_open_webuis_own_requests_through_the_router_stay_on_one_server_per_chat(
    open_webui: OpenWebUI, tmp_path: Path
) -> None:
    """Issue 30, item 3, with the real app's requests: everything this Open WebUI sent DSS in the
    tests above (kept by the recording proxy: its chat turns with the person and the chat in
    headers, regenerations, edits, model listings, whatever else it sends), sent again in the same
    order through the shipped router (deploy/haproxy.cfg, Open WebUI's chat header configured as
    deploy/cluster.py --session-header does) in front of three stub servers: every request of a
    chat reaches one server. The stubs (tests/router_stubs.py) stand in for three `dss serve`s,
    which would take three engines; tests/deploy/test_router.py routes to real ones."""
    try:
        haproxy = ensure_haproxy()
    except ClusterError as exc:
        pytest.skip(f"haproxy cannot be installed here: {exc}")
    sent = list(open_webui.proxy)
    chat_key = CHAT_HEADER.lower()
    if not any(chat_key in e.headers for e in sent):
        pytest.skip("no chat was recorded: this test replays the module's earlier tests' chats")
    landed: dict[str, set[str]] = {}
    with running_stubs("abc") as stubs:
        router = start_router(haproxy, stubs, tmp_path / "router", "abc", [CHAT_HEADER])
        try:
            with httpx.Client(base_url=router.router_url, timeout=30) as c:
                for e in sent:
                    headers = {k: v for k, v in e.headers.items() if k not in _NOT_FORWARDED}
                    where = served_by(c.request(e.method, e.path, headers=headers, content=e.body))
                    if chat_key in e.headers:
                        landed.setdefault(e.headers[chat_key], set()).add(where)
        finally:
            router.stop()
    print(f"{len(sent)} requests replayed; chats and their servers: {landed}")
    assert len(landed) >= 2, landed  # Alice's and Bob's chats at least
    assert all(len(servers) == 1 for servers in landed.values()), landed
