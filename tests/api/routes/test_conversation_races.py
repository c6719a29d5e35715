"""A Conversations API write admitted before an erasure of its user that commits after it writes
nothing (issue 28, item 3), without the engine: the real routes and store, the erasure run
between the request's admission and its store write.

Before the fix no Conversations write passed an admitted epoch to the write fence, so a
conversation created just before an erasure was committed after it, under the re-created user.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from dss.store import Store
from tests.api.test_unit import DEV, as_user, settings_for, started, state_of
from tests.db_helpers import count_user_rows

ITEM = {"type": "message", "role": "user", "content": "my secret"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        yield started(c)


def _conversation(c: TestClient, user: str) -> tuple[str, str]:
    """A conversation of `user` holding one item: (its id, the item's id)."""
    r = c.post("/v1/conversations", json={"items": [ITEM]}, headers=as_user(user))
    assert r.status_code == 200, r.text
    cid = r.json()["id"]
    items = c.get(f"/v1/conversations/{cid}/items", headers=as_user(user)).json()["data"]
    return cid, items[0]["id"]


# Each write: the VersionStore method its store write goes through, and the request.
WRITES: dict[str, tuple[str, Callable[[TestClient, str, str, str], Any]]] = {
    "create": (
        "create_session",
        lambda c, u, cid, iid: c.post(
            "/v1/conversations", json={"items": [ITEM], "metadata": {"k": "v"}}, headers=as_user(u)
        ),
    ),
    "create-empty": (
        "create_session",
        lambda c, u, cid, iid: c.post("/v1/conversations", json={}, headers=as_user(u)),
    ),
    "metadata": (
        "set_metadata",
        lambda c, u, cid, iid: c.post(
            f"/v1/conversations/{cid}", json={"metadata": {"k": "v"}}, headers=as_user(u)
        ),
    ),
    "add-items": (
        "commit",
        lambda c, u, cid, iid: c.post(
            f"/v1/conversations/{cid}/items", json={"items": [ITEM]}, headers=as_user(u)
        ),
    ),
    "delete-item": (
        "commit",
        lambda c, u, cid, iid: c.delete(f"/v1/conversations/{cid}/items/{iid}", headers=as_user(u)),
    ),
    "delete": (
        "delete_session",
        lambda c, u, cid, iid: c.delete(f"/v1/conversations/{cid}", headers=as_user(u)),
    ),
}


def _erasing_first(store: Store, user: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, run after an erasure of `user` (once): the erasure lands between the request's
    admission and its write."""
    done: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            store.eraser.erase_user(user)  # type: ignore[arg-type]
        return method(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_conversation_write_racing_an_erasure_writes_nothing(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    c, user = client, f"conv-race-{kind}"
    store = state_of(c).store
    cid, iid = ("conv_none", "msg_none") if kind.startswith("create") else _conversation(c, user)
    method, send = WRITES[kind]
    monkeypatch.setattr(store.versions, method, _erasing_first(store, user, getattr(store.versions, method)))
    r = send(c, user, cid, iid)
    monkeypatch.undo()
    # Refused as every other write racing an erasure is, and nothing of it was kept.
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "user_erased"
    assert count_user_rows(store.sf, user) == {"sessions": 0, "versions": 0, "branches": 0, "responses": 0}
    assert c.get("/v1/sessions", headers=as_user(user)).json()["data"] == []
    # The user, re-created, is served as usual.
    assert c.post("/v1/conversations", json={"items": [ITEM]}, headers=as_user(user)).status_code == 200
