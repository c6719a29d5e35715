"""Tenancy through the real server: users never see or reuse each other's state; public prefixes
are shared; admin-only endpoints refuse user keys; keys are required."""

from __future__ import annotations

import httpx
import pytest

from tests.api_server import ApiServer, api_server, chat, user_msg

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

PRIVATE = "Private notes of Ana: " + " ".join(
    f"Entry {i}: the garden gate code changed to {4000 + 37 * i} on day {i}." for i in range(30)
)
PUBLIC = "You are the help desk of the city library. " + " ".join(
    f"Policy {i}: books may be renewed {i % 3 + 1} times and returned at any branch." for i in range(25)
)


def cached(resp: dict[str, object]) -> int:
    usage = resp["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_another_users_session_is_404_and_their_cache_is_cold(api_server: ApiServer) -> None:
    ana, ben = api_server.client("tn-ana"), api_server.client("tn-ben")
    msgs = [{"role": "system", "content": PRIVATE}, user_msg("What is the gate code?")]
    first = chat(ana, msgs, session_id="tn-ana-1")
    again = chat(ana, msgs)  # same prompt, same user: served from cache
    assert cached(again) >= 256
    for method, path, body in [
        ("GET", "/v1/sessions/tn-ana-1", None),
        ("DELETE", "/v1/sessions/tn-ana-1", None),
        ("GET", "/v1/sessions/tn-ana-1/versions", None),
        ("GET", "/v1/sessions/tn-ana-1/versions/1", None),
        ("GET", "/v1/sessions/tn-ana-1/branches", None),
        ("POST", "/v1/sessions/tn-ana-1/rollback", {"to_version": 1}),
        ("POST", "/v1/sessions/tn-ana-1/branches", {"from_version": 1, "name": "mine"}),
        ("POST", "/v1/sessions/tn-ana-1/messages", {"content": "hi", "max_tokens": 2}),
    ]:
        r = ben.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    assert ben.get("/v1/sessions").json()["data"] == []
    # Ben's "tn-ana-1" is a session of his own (ids are per user): naming it neither reads nor
    # extends Ana's, and Ana's exact private prompt serves him nothing of hers.
    r = ben.post("/v1/chat/completions", json={"messages": msgs, "session_id": "tn-ana-1", "max_tokens": 4})
    assert r.status_code == 200, r.text
    cold = r.json()
    assert cached(cold) == 0 and cold["dss"]["loaded_tokens"] == 0 and cold["state_version"] == 1
    assert [s["id"] for s in ben.get("/v1/sessions").json()["data"]] == ["tn-ana-1"]
    assert ben.post("/v1/sessions", json={"session_id": "tn-ana-1"}).status_code == 409  # his own
    assert ana.get("/v1/sessions/tn-ana-1").json()["version_count"] == 1
    assert first["state_version"] == 1


def test_public_prefix_is_shared_and_admin_only(api_server: ApiServer) -> None:
    admin = api_server.client("admin", admin=True)
    user = api_server.client("tn-cleo")
    prefix_msgs = [{"role": "system", "content": PUBLIC}]
    denied = user.post("/v1/prefixes", json={"messages": prefix_msgs, "pin": True})
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    r = admin.post("/v1/prefixes", json={"messages": prefix_msgs, "pin": True})
    assert r.status_code == 201, r.text
    prefix = r.json()
    assert prefix["pinned"] is True and prefix["n_tokens"] > 256
    assert prefix["cached_tokens"] >= 256, prefix
    assert any(p["id"] == prefix["id"] for p in user.get("/v1/prefixes").json()["data"])
    # Two users who never met share the public part, and only that part.
    for name in ("tn-dora", "tn-eli"):
        c = api_server.client(name)
        resp = chat(c, [*prefix_msgs, user_msg(f"I am {name}; can I renew a book?")], session_id=f"{name}-s")
        assert resp["dss"]["loaded_tokens"] >= 256, resp["dss"]
        assert cached(resp) <= prefix["n_tokens"]
    assert user.delete(f"/v1/prefixes/{prefix['id']}").status_code == 403
    assert admin.delete(f"/v1/prefixes/{prefix['id']}").status_code == 200
    assert admin.delete(f"/v1/prefixes/{prefix['id']}").status_code == 404
    bad = admin.post("/v1/prefixes", json={"text": "too short", "pin": False})
    assert bad.status_code == 400


def test_keys_are_required_and_metrics_are_admin_only(api_server: ApiServer) -> None:
    base = api_server.base_url
    assert httpx.get(base + "/v1/sessions").status_code == 401
    bad = httpx.get(base + "/v1/sessions", headers={"Authorization": "Bearer dss-not-a-key"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    # The development-mode header means nothing once keys exist.
    assert httpx.get(base + "/v1/sessions", headers={"X-DSS-User": "tn-ana"}).status_code == 401
    assert httpx.get(base + "/healthz").status_code == 200
    assert api_server.client("tn-ana").get("/metrics").status_code == 403
    text = api_server.client("admin", admin=True).get("/metrics").text
    assert "dss_ttft_seconds_bucket" in text and "dss_tokens_hit_total" in text and "dss_pages{" in text
    for secret in ("tn-ana", "tn-ben", "tn-ana-1"):
        assert secret not in text
