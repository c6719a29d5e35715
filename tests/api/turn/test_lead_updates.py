"""Lead updates over HTTP on the real server (issue 27): a full-history client whose system prompt
carries the time (as Open WebUI, LibreChat and AnythingLLM template it) keeps extending its
session's version, and with lead updates on gets the history from cache; every such turn says
what happened in its `dss.lead_update` block, and a turn not served so says why."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.api_server import ApiServer, api_server, cached_tokens, small_api_server

__all__ = ["api_server", "small_api_server"]

pytestmark = pytest.mark.engine

START = datetime(2026, 12, 5, 9, 14, 2)
QUESTIONS = ["Name a red fruit.", "And a yellow one?", "Which of the two is sweeter?", "Thanks!"]


def system_at(t: datetime, persona: str = "You are a helpful assistant.") -> dict[str, str]:
    return {"role": "system", "content": f"{persona}\nCurrent date and time: {t:%Y-%m-%d %H:%M:%S}"}


def run_chat(
    client: httpx.Client, sid: str, turns: int, persona: str = "You are a helpful assistant.", **extra: Any
) -> list[dict[str, Any]]:
    """A full-history chat whose system prompt's time advances 47 s a turn."""
    history: list[dict[str, str]] = []
    answers = []
    for i in range(turns):
        history.append({"role": "user", "content": QUESTIONS[i]})
        body = {
            "messages": [system_at(START + timedelta(seconds=47 * i), persona), *history],
            "session_id": sid,
            "max_tokens": 12,
            "temperature": 0,
            **extra,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        answers.append(data)
        history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return answers


def test_off_by_default_later_turns_still_extend_the_session_and_say_why(api_server: ApiServer) -> None:
    with api_server.client("lead-off") as c:
        answers = run_chat(c, "clock-off", 3)
        # One conversation, one branch: each turn a child of the last (before: a fork-root each).
        assert [(a["parent_version"], a["branch"]) for a in answers] == [
            (None, "main"),
            (1, "main"),
            (2, "main"),
        ]
        for a in answers[1:]:
            lead = a["dss"]["lead_update"]
            assert lead["served"] is False and lead["reason"] == "off", lead
            assert lead["kind"] == "volatile" and lead["changed"], lead
            assert cached_tokens(a) < 0.5 * a["usage"]["prompt_tokens"]  # recomputed from the lead on
        assert answers[0]["dss"]["lead_update"] is None  # nothing stored to differ from


def test_on_per_request_the_history_comes_from_cache_and_the_change_is_stated(api_server: ApiServer) -> None:
    with api_server.client("lead-on") as c:
        answers = run_chat(c, "clock-on", 4, lead_updates="volatile")
        for a in answers[1:]:
            lead = a["dss"]["lead_update"]
            assert lead["served"] is True and lead["reason"] is None, lead
            assert lead["placement"] in ("note", "system") and lead["update_tokens"] > 0
            assert "Current date and time:" in lead["update"]
            (changed,) = lead["changed"]
            assert changed["old"] != changed["new"]
            # Every stored token is served from cache but the answer's last (it has no KV yet).
            assert cached_tokens(a) >= lead["reused_tokens"] - 1 > 0
        assert [a["branch"] for a in answers] == ["main"] * 4
        # The version keeps what the client sent: its system prompt is the request's.
        v = c.get("/v1/sessions/clock-on/versions/4").json()
        assert v["messages"][0] == system_at(START + timedelta(seconds=47 * 3))


def test_a_persona_edit_is_not_a_volatile_change_unless_any_is_asked_for(api_server: ApiServer) -> None:
    with api_server.client("lead-persona") as c:
        first = run_chat(c, "persona", 1, lead_updates="volatile")[0]
        msgs = [
            {"role": "system", "content": "You are a pirate. Answer like one."},
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": QUESTIONS[1]},
        ]
        body = {"messages": msgs, "session_id": "persona", "max_tokens": 8, "temperature": 0}
        volatile = c.post("/v1/chat/completions", json={**body, "lead_updates": "volatile"}).json()
        lead = volatile["dss"]["lead_update"]
        assert (lead["served"], lead["reason"], lead["kind"]) == (
            False,
            "changed_beyond_volatile_values",
            "prompt",
        )
        anything = c.post("/v1/chat/completions", json={**body, "lead_updates": "any"}).json()
        lead = anything["dss"]["lead_update"]
        assert (lead["served"], lead["kind"]) == (True, "prompt")
        assert lead["update"] == "You are a pirate. Answer like one."


def test_the_header_overrides_and_a_bad_mode_is_a_400(api_server: ApiServer) -> None:
    with api_server.client("lead-header") as c:
        c.headers["X-DSS-Lead-Updates"] = "volatile"
        answers = run_chat(c, "via-header", 2)
        assert answers[1]["dss"]["lead_update"]["served"] is True
        c.headers["X-DSS-Lead-Updates"] = "sometimes"
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        )
        assert r.status_code == 400 and "lead_updates" in r.json()["error"]["message"], r.text
        del c.headers["X-DSS-Lead-Updates"]
        bad = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "lead_updates": "always"}
        assert c.post("/v1/chat/completions", json=bad).status_code == 400


def test_responses_whose_instructions_carry_the_time_continue_their_chain(api_server: ApiServer) -> None:
    with api_server.client("lead-resp") as c:
        previous = None
        outs = []
        for i, q in enumerate(QUESTIONS[:3]):
            body: dict[str, Any] = {
                "input": q,
                "instructions": system_at(START + timedelta(seconds=47 * i))["content"],
                "max_output_tokens": 8,
                "temperature": 0,
                "lead_updates": "volatile",
            }
            if previous:
                body["previous_response_id"] = previous
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            outs.append(r.json())
            previous = outs[-1]["id"]
        for o in outs[1:]:
            lead = o["dss"]["lead_update"]
            assert lead["served"] is True, lead
            details = o["usage"]["input_tokens_details"]
            assert details["cached_tokens"] >= lead["reused_tokens"] - 1 > 0


def test_the_quality_gate_turns_lead_updates_off_when_agreement_falls_and_says_so(
    small_api_server: ApiServer,
) -> None:
    """The `small` server's gate checks every lead update and trips on any first-token distance:
    forced low, as a frontend whose updates changed the answers would be."""
    server = small_api_server
    with server.client("gate-user") as c, server.client("gate-admin", admin=True) as admin:
        served = run_chat(c, "gated", 2, lead_updates="volatile")[1]
        assert served["dss"]["lead_update"]["served"] is True
        deadline = time.monotonic() + 120
        figures: list[dict[str, Any]] = []
        while time.monotonic() < deadline:  # the shadow check runs after the answer, in the background
            figures = admin.get("/v1/admin/lead-gate").json()["data"]
            if figures and figures[0]["tripped"]:
                break
            time.sleep(0.5)
        (fig,) = figures
        assert fig["frontend"] == "(server)" and fig["tripped"] and fig["checks"] == 1, fig
        assert 0 < fig["mean_distance"] <= 1 and fig["first_token_agreement"] in (0.0, 1.0)
        metrics = admin.get("/metrics").text
        assert (
            "dss_lead_gate_tripped 1.0" in metrics
            and 'dss_lead_update_turns_total{outcome="served"}' in metrics
        )

        gated = run_chat(c, "gated-2", 2, lead_updates="volatile")[1]["dss"]["lead_update"]
        assert (gated["served"], gated["reason"]) == (False, "quality_gate_tripped")

        assert admin.post("/v1/admin/lead-gate/(server)/reset").status_code == 200
        again = run_chat(c, "gated-3", 2, lead_updates="volatile")[1]["dss"]["lead_update"]
        assert again["served"] is True
        assert c.get("/v1/admin/lead-gate").status_code == 403  # figures are the operator's


def test_truncation_auto_cuts_in_one_large_step_and_later_turns_extend_it(api_server: ApiServer) -> None:
    """A stateful session that outgrows the 2048-token context: refused without truncation; with
    `truncation: "auto"` cut once, and the next turn serves the shortened prefix from cache."""
    long = "Tell me more about rivers. " * 60  # ~360 tokens a message
    with api_server.client("trunc") as c:
        assert c.post(
            "/v1/sessions", json={"session_id": "long", "system_prompt": "Be brief."}
        ).status_code in (
            200,
            201,
        )
        body: dict[str, Any] = {"content": long, "max_tokens": 16, "temperature": 0}
        answers = []
        for _ in range(12):
            r = c.post("/v1/sessions/long/messages", json=body)
            if r.status_code == 400:
                assert r.json()["error"]["code"] == "context_length_exceeded", r.text
                break
            assert r.status_code == 200, r.text
            answers.append(r.json())
        else:
            pytest.fail("the dialogue never outgrew the context")
        cut = c.post("/v1/sessions/long/messages", json={**body, "truncation": "auto"})
        assert cut.status_code == 200, cut.text
        first = cut.json()
        dropped = first["dss"]["truncated_messages"]
        assert dropped >= 2 and dropped % 2 == 0  # whole turns, from a user message on
        assert first["usage"]["prompt_tokens"] <= 2048 // 2 + 400
        after = c.post("/v1/sessions/long/messages", json={**body, "truncation": "auto"}).json()
        assert after["dss"]["truncated_messages"] == dropped  # the same cut: the same prefix
        assert cached_tokens(after) >= first["usage"]["prompt_tokens"]  # the cut prompt from cache
        # The version keeps every message; the model saw the shortened dialogue.
        v = c.get(f"/v1/sessions/long/versions/{after['state_version']}").json()
        assert len(v["messages"]) == 2 * (len(answers) + 2) + 1


def test_responses_truncation_auto_is_accepted_and_echoed(api_server: ApiServer) -> None:
    with api_server.client("trunc-resp") as c:
        r = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, "truncation": "auto"})
        assert r.status_code == 200, r.text
        assert r.json()["truncation"] == "auto"
        bad = c.post("/v1/responses", json={"input": "Hi", "truncation": "sometimes"})
        assert bad.status_code == 400


def test_a_conversation_whose_instructions_carry_the_time_is_served_from_cache(api_server: ApiServer) -> None:
    with api_server.client("lead-conv") as c:
        conv = c.post("/v1/conversations", json={})
        assert conv.status_code == 200, conv.text
        cid = conv.json()["id"]
        outs = []
        for i, q in enumerate(QUESTIONS[:3]):
            body = {
                "conversation": cid,
                "input": q,
                "instructions": system_at(START + timedelta(seconds=47 * i))["content"],
                "max_output_tokens": 8,
                "temperature": 0,
                "lead_updates": "volatile",
            }
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            outs.append(r.json())
        for o in outs[1:]:
            lead = o["dss"]["lead_update"]
            assert lead["served"] is True, lead
            assert o["usage"]["input_tokens_details"]["cached_tokens"] >= lead["reused_tokens"] - 1 > 0


def test_a_chat_that_names_no_session_gets_one_by_content_with_lead_updates_on(api_server: ApiServer) -> None:
    """LibreChat sends only `user`: with lead updates on, its chat is named by its first user
    message, so its later turns find the earlier ones (off: no session, as before)."""
    with api_server.client("lead-nosession") as c:
        history: list[dict[str, str]] = []
        answers = []
        for i in range(3):
            history.append({"role": "user", "content": QUESTIONS[i]})
            body = {
                "messages": [system_at(START + timedelta(seconds=47 * i)), *history],
                "max_tokens": 8,
                "temperature": 0,
                "lead_updates": "volatile",
            }
            data = c.post("/v1/chat/completions", json=body).json()
            answers.append(data)
            history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        sids = {a["session_id"] for a in answers}
        assert len(sids) == 1 and sids.pop().startswith("auto-")
        assert [a["state_version"] for a in answers] == [1, 2, 3]
        assert all(a["dss"]["lead_update"]["served"] for a in answers[1:])
        plain = c.post("/v1/chat/completions", json={"messages": history[:1], "max_tokens": 2}).json()
        assert plain.get("session_id") is None  # off: a chat of no session
