"""Chat turns on frontend keys, through the official `openai` client against the real server
(issue 22, items 1-2): requests shaped as Open WebUI sends them (the whole history every time,
its user and chat id as forwarded headers), with "regenerate" and "edit an earlier message";
LibreChat's `user` field and OpenAI's `safety_identifier`; vLLM's `X-Session-ID`.

All modules share one engine-backed server (`tests.api_server`); frontend keys are created in its
database the way `dss keys create --frontend` does."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.keys.api_keys import ApiKeys
from api.keys.audit import ACTOR_CLI
from api.keys.frontends import Frontends
from dss.db.connect import make_engine, make_session_factory, sqlite_url_for
from tests.api_server import ApiServer, api_server, cached_tokens

__all__ = ["api_server"]  # the shared real-engine server (a fixture)

pytestmark = pytest.mark.engine

WEBUI_USER = "X-OpenWebUI-User-Id"
WEBUI_CHAT = "X-OpenWebUI-Chat-Id"
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}


def frontend_key(server: ApiServer, name: str, user_headers: list[str], session_header: str | None) -> str:
    engine = make_engine(sqlite_url_for(server.data_dir))
    try:
        sf = make_session_factory(engine)
        frontends = Frontends(sf)
        if frontends.find(name) is None:
            frontends.create(name, user_headers, session_header, ACTOR_CLI)
        return ApiKeys(sf).create(frontend=name).key
    finally:
        engine.dispose()


def openai_client(server: ApiServer, key: str, headers: dict[str, str] | None = None) -> Any:
    import openai

    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=key, timeout=180.0, max_retries=0, default_headers=headers
    )


def turn(client: Any, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    answer: Any = client.chat.completions.create(model="default", messages=messages, **{**GREEDY, **extra})
    dumped: dict[str, Any] = answer.model_dump()
    return dumped


def versions(server: ApiServer, key: str, headers: dict[str, str], sid: str) -> dict[int, dict[str, Any]]:
    r = httpx.get(
        f"{server.base_url}/v1/sessions/{sid}/versions",
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return {v["number"]: v for v in r.json()["data"]}


def test_open_webui_regenerate_and_edit_fork_with_the_prefix_from_cache(api_server: ApiServer) -> None:
    """Open WebUI sends the whole dialogue each time. "Regenerate" repeats an earlier request
    (a new answer to the same history): a sibling version on a branch of its own. "Edit" cuts the
    history at a message and changes it: a fork there. Both serve the shared prefix from cache."""
    key = frontend_key(api_server, "owui", [WEBUI_USER], WEBUI_CHAT)
    who = {WEBUI_USER: "3f1c-alice", WEBUI_CHAT: "9d2e-chat"}
    client = openai_client(api_server, key, who)
    system = {"role": "system", "content": "You are a helpful assistant."}
    u1 = {"role": "user", "content": "Name a fruit that is red."}

    first = turn(client, [system, u1])
    assert (first["session_id"], first["state_version"], first["branch"]) == ("9d2e-chat", 1, "main")
    a1 = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    u2 = {"role": "user", "content": "And one that is yellow?"}
    second = turn(client, [system, u1, a1, u2])
    assert (second["state_version"], second["branch"]) == (2, "main")
    assert cached_tokens(second) > 0

    regenerated = turn(client, [system, u1, a1, u2], temperature=1.0, seed=7)  # a new answer, same history
    assert regenerated["state_version"] == 3 and regenerated["branch"] not in ("main", None)
    assert cached_tokens(regenerated) > 0

    u2_edited = {"role": "user", "content": "And one that is green?"}
    edited = turn(client, [system, u1, a1, u2_edited])
    assert edited["state_version"] == 4 and edited["branch"] not in ("main", regenerated["branch"])
    assert cached_tokens(edited) > 0

    u1_edited = {"role": "user", "content": "Name a fruit that is blue."}
    edited_first = turn(client, [system, u1_edited])
    assert edited_first["state_version"] == 5

    tree = versions(api_server, key, who, "9d2e-chat")
    assert {n: tree[n]["parent"] for n in tree} == {1: None, 2: 1, 3: 1, 4: 1, 5: None}
    assert tree[2]["branch"] == "main"
    assert len({tree[n]["branch"] for n in (2, 3, 4, 5)}) == 4  # each its own branch

    # Another person of the same frontend, same chat id: their own session, nothing cached of alice's.
    bob = openai_client(api_server, key, {WEBUI_USER: "77aa-bob", WEBUI_CHAT: "9d2e-chat"})
    theirs = turn(bob, [system, u1])
    assert (theirs["state_version"], theirs["branch"]) == (1, "main")
    # Another tenant, another cache salt: alice's stored turn would have served all of the
    # prompt but its last token. (Its first tokens, the template's header, may come from a public
    # prefix that another module of the shared server registered.)
    assert cached_tokens(theirs) < theirs["usage"]["prompt_tokens"] - 1 == first["usage"]["prompt_tokens"] - 1


def test_librechats_user_field_and_safety_identifier_name_the_end_user(api_server: ApiServer) -> None:
    key = frontend_key(api_server, "librechat", [], None)
    client = openai_client(api_server, key)
    q = [{"role": "user", "content": "Say hi."}]
    answer = turn(client, q, user="ann", extra_headers={"X-Session-ID": "lc-1"})
    assert answer["session_id"] == "lc-1"
    as_ann = {"Authorization": f"Bearer {key}", "X-DSS-User": "ann"}
    listed = httpx.get(f"{api_server.base_url}/v1/sessions", headers=as_ann, timeout=30).json()["data"]
    assert [s["id"] for s in listed] == ["lc-1"]

    response = client.responses.create(
        model="default", input="Say hi.", max_output_tokens=4, safety_identifier="ben"
    )
    as_ben = {"Authorization": f"Bearer {key}", "X-DSS-User": "ben"}
    assert (
        httpx.get(f"{api_server.base_url}/v1/responses/{response.id}", headers=as_ben, timeout=30).status_code
        == 200
    )
    assert (
        httpx.get(f"{api_server.base_url}/v1/responses/{response.id}", headers=as_ann, timeout=30).status_code
        == 404
    )

    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        turn(client, q)
    assert refused.value.code == "end_user_required" and "`user`" in refused.value.message
    with pytest.raises(openai.BadRequestError) as conflict:
        turn(client, q, user="ann", extra_headers={"X-DSS-User": "ben"})
    assert conflict.value.code == "end_user_conflict"
    with pytest.raises(openai.BadRequestError) as conflict:
        turn(client, q, user="ann", extra_body={"safety_identifier": "ben"})
    assert conflict.value.code == "end_user_conflict"


def test_a_user_key_ignores_frontend_headers_and_the_user_field(api_server: ApiServer) -> None:
    client = openai_client(api_server, api_server.key("carla"), {WEBUI_USER: "ann", "X-DSS-User": "ann"})
    answer = turn(
        client, [{"role": "user", "content": "Hi."}], user="ann", extra_headers={"X-DSS-Session": "c-1"}
    )
    assert answer["session_id"] == "c-1"
    with api_server.client("carla") as c:
        assert [s["id"] for s in c.get("/v1/sessions").json()["data"]] == ["c-1"]


def test_vllms_session_header_names_a_chats_session(api_server: ApiServer) -> None:
    """vLLM's own clients name the session with `X-Session-ID`: it was ignored (a sessionless turn)."""
    client = openai_client(api_server, api_server.key("vera"), {"X-Session-ID": "vllm-chat"})
    q1 = [{"role": "user", "content": "Name a colour."}]
    first = turn(client, q1)
    assert (first["session_id"], first["state_version"]) == ("vllm-chat", 1)
    q2 = [*q1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
          {"role": "user", "content": "Another?"}]  # fmt: skip
    second = turn(client, q2)
    assert (second["state_version"], second["branch"]) == (2, "main") and cached_tokens(second) > 0
