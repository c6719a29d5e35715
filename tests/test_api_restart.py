"""Restart: stop the real server, start it again on the same data directory; the session's next
turn is served from the disk tier (the host arena and the engine's own cache died with the process)."""

from __future__ import annotations

import pytest

from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

SYSTEM = "You are the archivist of a railway museum. " + " ".join(
    f"Exhibit {i}: locomotive number {300 + i} built in {1890 + i} ran the {i}th northern line."
    for i in range(26)
)


def test_next_turn_after_a_restart_is_served_from_disk(api_server: ApiServer) -> None:
    c = api_server.client("rs-jo")
    assert c.post("/v1/sessions", json={"session_id": "rs-1", "system_prompt": SYSTEM}).status_code == 201
    for q in ("Which locomotive is the oldest?", "And which is the newest?"):
        r = c.post("/v1/sessions/rs-1/messages", json={"content": q, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200, r.text
    before = c.get("/v1/sessions/rs-1/versions").json()["data"][-1]
    assert sum(before["resident"].values()) >= 256

    api_server.restart()  # graceful: the store flushes write-through and closes

    c = api_server.client("rs-jo")
    after = c.get("/v1/sessions/rs-1/versions").json()["data"]
    assert [v["number"] for v in after] == [1, 2]
    assert after[-1]["resident"]["host"] == 0 and after[-1]["resident"]["disk"] >= 256, after[-1]
    r = c.post(
        "/v1/sessions/rs-1/messages", json={"content": "Who built them?", "max_tokens": 10, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["state_version"] == 3 and data["parent_version"] == 2
    dss = data["dss"]
    # Nothing was in the new engine's cache: every cached token came from DSS, read from disk.
    assert dss["engine_cached_tokens"] == 0 and dss["loaded_tokens"] >= 256, dss
    assert dss["loaded_from"]["disk"] >= 256 and dss["resident"]["host"] == 0, dss
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == dss["loaded_tokens"]
