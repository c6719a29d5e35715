"""Erasing a user through the real server: receipt, verification, nothing left on disk, cold restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dss.errors import DSSError
from dss.pages.pagefile import HEADER_LEN, read_header
from tests.api_server import ApiServer, api_server, chat, user_msg

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

DIARY = "Diary of Ivy, strictly private. " + " ".join(
    f"Day {i}: I met my friend number {i * 13} at the blue cafe and we talked about plan {i}."
    for i in range(28)
)


def page_tenants(data_dir: Path) -> dict[str, int]:
    """Page files on the disk tier by the tenant written in their header."""
    out: dict[str, int] = {}
    for f in (data_dir / "pages").rglob("*.page"):
        try:
            with open(f, "rb") as fh:
                header = read_header(fh.read(HEADER_LEN))
        except (OSError, DSSError):
            continue  # removed while listing, or a file being written
        out[header.tenant] = out.get(header.tenant, 0) + 1
    return out


def settled_tenants(data_dir: Path, timeout_s: float = 20.0) -> set[str]:
    """The tenants on disk once earlier tests' write-through has finished (two equal looks)."""
    last = page_tenants(data_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = page_tenants(data_dir)
        if now == last:
            return set(now)
        last = now
    return set(last)


def wait_for_new_tenant(data_dir: Path, before: set[str], timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = set(page_tenants(data_dir)) - before
        if len(fresh) == 1:
            return fresh.pop()
        time.sleep(0.2)
    raise AssertionError(
        f"no single new tenant reached the disk tier: {set(page_tenants(data_dir)) - before}"
    )


def test_erase_user_leaves_no_trace_and_a_verifiable_receipt(api_server: ApiServer) -> None:
    ivy = api_server.client("er-ivy")
    msgs = [{"role": "system", "content": DIARY}, user_msg("Who did I meet on day 3?")]
    before = settled_tenants(api_server.data_dir)
    r1 = chat(ivy, msgs, session_id="er-1")
    chat(ivy, [*msgs, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
               user_msg("And on day 4?")], session_id="er-1")  # fmt: skip
    tenant = wait_for_new_tenant(api_server.data_dir, before)
    assert page_tenants(api_server.data_dir)[tenant] >= 2

    # Nobody else may erase Ivy; she may erase herself.
    assert api_server.client("er-mallory").delete("/v1/users/er-ivy").status_code == 403
    r = ivy.delete("/v1/users/er-ivy")
    assert r.status_code == 200, r.text
    receipt = r.json()
    assert receipt["object"] == "erasure.receipt" and receipt["id"].startswith("era_")
    assert "er-ivy" not in r.text and len(receipt["subject"]) >= 16
    assert receipt["counts"]["sessions"] == 1 and receipt["counts"]["versions"] == 2
    assert receipt["verification"]["remnants"] == 0 and receipt["verification"]["chain_ok"] is True

    # Her sessions are gone, and no page of hers is left on disk.
    assert ivy.get("/v1/sessions").json()["data"] == []
    assert ivy.get("/v1/sessions/er-1").status_code == 404
    assert tenant not in page_tenants(api_server.data_dir)

    # The receipt verifies again later; other users cannot read it.
    again = api_server.client("admin", admin=True).get(f"/v1/erasures/{receipt['id']}")
    assert again.status_code == 200 and again.json()["verification"]["remnants"] == 0
    assert again.json()["verification"]["checked_at"] > receipt["verification"]["checked_at"]
    assert ivy.get(f"/v1/erasures/{receipt['id']}").status_code == 200
    assert api_server.client("er-mallory").get(f"/v1/erasures/{receipt['id']}").status_code == 404
    assert ivy.get("/v1/erasures/era_doesnotexist").status_code == 404

    # A user re-created under the same id starts cold: nothing cached survives the erasure.
    fresh = chat(ivy, msgs, session_id="er-1")
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["state_version"] == 1


@pytest.mark.parametrize("n", [1, 2])
def test_erasing_a_user_mid_stream_keeps_nothing_of_the_stream(api_server: ApiServer, n: int) -> None:
    """alice streams a long answer and erases herself 'during' it: the stream ended normally and
    its pages were written again under her tenant, and a re-created alice was served the erased
    KV from cache. Now her generation is stopped (no version), nothing of her tenant is written
    after the erasure, and the re-created alice is a new tenant that starts cold. With `n`
    alternatives, none of them is committed."""
    user = f"mid-alice-{n}"
    alice = api_server.client(user)
    msgs = [{"role": "system", "content": DIARY}, user_msg("Tell me about every day, one by one.")]
    body = {
        "model": "default",
        "messages": msgs,
        "session_id": "mid-1",
        "stream": True,
        "max_tokens": 400,
        "n": n,
    }
    # The session first, so that the erasure finds something whatever the stream saved by then
    # (an erasure of nothing writes no receipt, and this test reads it back).
    assert alice.post("/v1/sessions", json={"session_id": "mid-1"}).status_code == 201
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with api_server.client(user).stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if '"content":"' in line and '"content":""' not in line:
                    first_chunk.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first_chunk.wait(120), f"the stream never produced text: {lines[-3:]}"
    r = alice.delete(f"/v1/users/{user}")
    assert r.status_code == 200, r.text
    receipt = r.json()
    t.join(120)
    assert not t.is_alive()
    assert any("erased_during_generation" in line for line in lines), lines[-3:]
    assert not any('"state_version"' in line for line in lines)  # no version was committed
    assert alice.get("/v1/sessions/mid-1").status_code == 404
    time.sleep(2)  # what a late save of the stream would have written has landed by now
    assert receipt["subject"] not in page_tenants(api_server.data_dir)
    again = api_server.client("admin", admin=True).get(f"/v1/erasures/{receipt['id']}").json()
    assert again["verification"]["remnants"] == 0, again["verification"]["details"]
    fresh = chat(alice, msgs, session_id="mid-1", max_tokens=4)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_admins_list_receipts_newest_first_and_users_may_not(api_server: ApiServer) -> None:
    admin = api_server.client("admin", admin=True)
    ids = []
    for user in ("er-list-a", "er-list-b", "er-list-c"):
        # Something to erase: an erasure of a user who holds nothing writes no receipt.
        assert api_server.client(user).post("/v1/sessions", json={"session_id": "s"}).status_code == 201
        r = admin.delete(f"/v1/users/{user}")
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    page = admin.get("/v1/erasures", params={"limit": 2})
    assert page.status_code == 200, page.text
    body = page.json()
    assert [x["id"] for x in body["data"]] == [ids[2], ids[1]] and body["has_more"] is True
    assert body["last_id"] == ids[1] and "verification" not in body["data"][0]
    assert "er-list" not in page.text  # subjects are salted hashes
    after = admin.get("/v1/erasures", params={"limit": 1, "after": ids[1]}).json()
    assert [x["id"] for x in after["data"]] == [ids[0]]
    # The subjects are other users': not for user keys. Bad cursors and limits are typed errors.
    assert api_server.client("er-list-a").get("/v1/erasures").status_code == 403
    missing = admin.get("/v1/erasures", params={"after": "era_doesnotexist"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "receipt_not_found", missing.text
    assert admin.get("/v1/erasures", params={"limit": 0}).status_code == 400
