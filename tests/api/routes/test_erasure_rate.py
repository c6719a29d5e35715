"""Verifying erasures is rate-limited per user: `DELETE /v1/users/{self}` and
`GET /v1/erasures/{id}` share one token bucket per user; admins are not limited."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from tests.api.test_unit import make_key, settings_for, started

LIMITS = {"erasure_checks_per_minute": 1.0, "erasure_checks_burst": 2}


def test_erasure_checks_are_rate_limited_per_user(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ursula, vera = make_key(data, "ursula"), make_key(data, "vera")
    admin = make_key(data, None, admin=True)
    with TestClient(create_app(settings_for(data, limits=LIMITS))) as c:
        started(c)
        auth = {"Authorization": f"Bearer {ursula}"}
        # Something to erase (an erasure of nothing writes no receipt to check).
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=auth).status_code == 201
        r = c.delete("/v1/users/ursula", headers=auth)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert c.get(f"/v1/erasures/{rid}", headers=auth).status_code == 200
        r = c.get(f"/v1/erasures/{rid}", headers=auth)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert c.delete("/v1/users/ursula", headers=auth).status_code == 429  # the same bucket
        # Another user has a bucket of their own, and an admin is not limited.
        assert c.delete("/v1/users/vera", headers={"Authorization": f"Bearer {vera}"}).status_code == 200
        for _ in range(5):
            got = c.get(f"/v1/erasures/{rid}", headers={"Authorization": f"Bearer {admin}"})
            assert got.status_code == 200, got.text


def test_token_buckets_refill_and_say_how_long_to_wait() -> None:
    from api.ratelimit import TokenBuckets

    now = [100.0]
    buckets = TokenBuckets(per_minute=6, burst=2, clock=lambda: now[0], max_keys=1)
    assert buckets.take("a") == 0 and buckets.take("a") == 0
    assert buckets.take("a") == 10  # one token every 10 s
    now[0] += 4
    assert buckets.take("a") == 6
    now[0] += 6
    assert buckets.take("a") == 0 and buckets.take("b") == 0
    now[0] += 60  # both full again: dropped once the table outgrows max_keys
    assert buckets.take("c") == 0
    assert TokenBuckets(per_minute=0, burst=1).take("a") == 0  # 0: unlimited
