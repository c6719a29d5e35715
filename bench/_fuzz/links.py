"""OpenAPI `links` added to the app's schema (the app declares none, and the campaign must not
change the app): from a created session to its reads and turns, from a turn to its version, a
rollback, a branch, a turn on it, from a response to its reads, deletion and continuation, from a
conversation to its items and deletion, from a frontend's list of end users to an erasure
(`bench/schemathesis_stateful.py` lists them all)."""

from __future__ import annotations

from typing import Any

# (method, path) of the operations the links connect; the operationIds are looked up.
CREATE_SESSION = ("post", "/v1/sessions")
LIST_SESSIONS = ("get", "/v1/sessions")
GET_SESSION = ("get", "/v1/sessions/{session_id}")
DELETE_SESSION = ("delete", "/v1/sessions/{session_id}")
MESSAGES = ("post", "/v1/sessions/{session_id}/messages")
VERSIONS = ("get", "/v1/sessions/{session_id}/versions")
VERSION = ("get", "/v1/sessions/{session_id}/versions/{number}")
ROLLBACK = ("post", "/v1/sessions/{session_id}/rollback")
BRANCHES_POST = ("post", "/v1/sessions/{session_id}/branches")
BRANCHES_GET = ("get", "/v1/sessions/{session_id}/branches")
CHAT = ("post", "/v1/chat/completions")
PATCH_SESSION = ("patch", "/v1/sessions/{session_id}")
WARM = ("post", "/v1/sessions/{session_id}/warm")
RESPONSES = ("post", "/v1/responses")
RESPONSE = ("get", "/v1/responses/{response_id}")
RESPONSE_DELETE = ("delete", "/v1/responses/{response_id}")
RESPONSE_ITEMS = ("get", "/v1/responses/{response_id}/input_items")
CONVERSATIONS = ("post", "/v1/conversations")
CONVERSATION = ("get", "/v1/conversations/{conversation_id}")
CONVERSATION_UPDATE = ("post", "/v1/conversations/{conversation_id}")
CONVERSATION_DELETE = ("delete", "/v1/conversations/{conversation_id}")
ITEMS = ("get", "/v1/conversations/{conversation_id}/items")
ITEMS_ADD = ("post", "/v1/conversations/{conversation_id}/items")
ITEM = ("get", "/v1/conversations/{conversation_id}/items/{item_id}")
ITEM_DELETE = ("delete", "/v1/conversations/{conversation_id}/items/{item_id}")
LIST_USERS = ("get", "/v1/users")
ERASE_USER = ("delete", "/v1/users/{user_id}")

SID_BODY = "$response.body#/id"
SID_TURN = "$response.body#/session_id"
SID_REQ = "$request.path.session_id"
NEW_VERSION = "$response.body#/state_version"
FIRST_ID = "$response.body#/data/0/id"
HEAD = "$response.body#/head_version"
RID = "$response.body#/id"


def _links() -> list[tuple[tuple[str, str], str, str, tuple[str, str], dict[str, Any]]]:
    """(source, status, name, target, {parameters?, requestBody?})."""
    turn_links: list[tuple[str, tuple[str, str], dict[str, Any]]] = [
        ("TheVersion", VERSION, {"parameters": {"path.session_id": SID_TURN, "path.number": NEW_VERSION}}),
        ("TheVersions", VERSIONS, {"parameters": {"path.session_id": SID_TURN}}),
        (
            "RollbackToIt",
            ROLLBACK,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"to_version": NEW_VERSION}},
        ),
        (
            "BranchFromIt",
            BRANCHES_POST,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"from_version": NEW_VERSION}},
        ),
        (
            "ContinueIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"version": NEW_VERSION}},
        ),
        ("TheSession", GET_SESSION, {"parameters": {"path.session_id": SID_TURN}}),
        (
            "WarmIt",
            WARM,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"version": NEW_VERSION}},
        ),
        ("HintIt", PATCH_SESSION, {"parameters": {"path.session_id": SID_TURN}}),
    ]
    rid = {"parameters": {"path.response_id": RID}}
    r_sid = "$response.body#/dss/session_id"
    out: list[tuple[tuple[str, str], str, str, tuple[str, str], dict[str, Any]]] = []
    for src in (CHAT, MESSAGES):
        out += [(src, "200", name, dst, spec) for name, dst, spec in turn_links]
    sid = {"parameters": {"path.session_id": SID_BODY}}
    out += [
        (CREATE_SESSION, "201", "GetIt", GET_SESSION, sid),
        (CREATE_SESSION, "201", "ItsVersions", VERSIONS, sid),
        (CREATE_SESSION, "201", "ItsBranches", BRANCHES_GET, sid),
        (CREATE_SESSION, "201", "FirstMessage", MESSAGES, sid),
        (CREATE_SESSION, "201", "DeleteIt", DELETE_SESSION, sid),
        (CREATE_SESSION, "201", "ChatInIt", CHAT, {"requestBody": {"session_id": SID_BODY}}),
        (CREATE_SESSION, "201", "HintIt", PATCH_SESSION, sid),
        (CREATE_SESSION, "201", "WarmIt", WARM, sid),
        (PATCH_SESSION, "200", "TheSession", GET_SESSION, sid),
        (PATCH_SESSION, "200", "WarmIt", WARM, sid),
        (RESPONSES, "200", "GetIt", RESPONSE, rid),
        (RESPONSES, "200", "ItsInputItems", RESPONSE_ITEMS, rid),
        (RESPONSES, "200", "DeleteIt", RESPONSE_DELETE, rid),
        (RESPONSES, "200", "ContinueIt", RESPONSES, {"requestBody": {"previous_response_id": RID}}),
        (RESPONSES, "200", "ItsSession", GET_SESSION, {"parameters": {"path.session_id": r_sid}}),
        (
            RESPONSES,
            "200",
            "ItsVersion",
            VERSION,
            {"parameters": {"path.session_id": r_sid, "path.number": "$response.body#/dss/version"}},
        ),
        (RESPONSE, "200", "ContinueIt", RESPONSES, {"requestBody": {"previous_response_id": RID}}),
        (RESPONSE, "200", "DeleteIt", RESPONSE_DELETE, rid),
        (GET_SESSION, "200", "ItsVersions", VERSIONS, sid),
        (GET_SESSION, "200", "ItsBranches", BRANCHES_GET, sid),
        (GET_SESSION, "200", "DeleteIt", DELETE_SESSION, sid),
        (LIST_SESSIONS, "200", "FirstSession", GET_SESSION, {"parameters": {"path.session_id": FIRST_ID}}),
        (
            VERSIONS,
            "200",
            "FirstVersion",
            VERSION,
            {"parameters": {"path.session_id": SID_REQ, "path.number": "$response.body#/data/0/number"}},
        ),
        (
            BRANCHES_POST,
            "201",
            "MessageOnIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_REQ}, "requestBody": {"branch": "$response.body#/name"}},
        ),
        (
            BRANCHES_POST,
            "201",
            "RollItBack",
            ROLLBACK,
            {
                "parameters": {"path.session_id": SID_REQ},
                "requestBody": {"branch": "$response.body#/name", "to_version": HEAD},
            },
        ),
        (BRANCHES_POST, "201", "TheBranches", BRANCHES_GET, {"parameters": {"path.session_id": SID_REQ}}),
        (ROLLBACK, "200", "TheSession", GET_SESSION, {"parameters": {"path.session_id": SID_REQ}}),
        (
            ROLLBACK,
            "200",
            "MessageOnIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_REQ}, "requestBody": {"branch": "$response.body#/name"}},
        ),
    ]  # fmt: skip
    return out


def _conversation_links() -> list[tuple[tuple[str, str], str, str, tuple[str, str], dict[str, Any]]]:
    """A conversation's life: created -> read, items added -> an item read or deleted -> the
    conversation deleted (then read: it must stay gone); a response in it; and, for a frontend
    key, its end users listed -> the first one erased (the end user the run acts as, usually)."""
    cid = {"parameters": {"path.conversation_id": SID_BODY}}
    cid_req = "$request.path.conversation_id"
    first_item = {
        "parameters": {"path.conversation_id": cid_req, "path.item_id": "$response.body#/data/0/id"}
    }
    return [
        (CONVERSATIONS, "200", "GetIt", CONVERSATION, cid),
        (CONVERSATIONS, "200", "ItsItems", ITEMS, cid),
        (CONVERSATIONS, "200", "AddItems", ITEMS_ADD, cid),
        (CONVERSATIONS, "200", "UpdateIt", CONVERSATION_UPDATE, cid),
        (CONVERSATIONS, "200", "DeleteIt", CONVERSATION_DELETE, cid),
        (CONVERSATIONS, "200", "RespondInIt", RESPONSES, {"requestBody": {"conversation": SID_BODY}}),
        (ITEMS_ADD, "200", "TheItem", ITEM, first_item),
        (ITEMS_ADD, "200", "DeleteTheItem", ITEM_DELETE, first_item),
        (ITEMS_ADD, "200", "TheItems", ITEMS, {"parameters": {"path.conversation_id": cid_req}}),
        (ITEMS, "200", "FirstItem", ITEM, first_item),
        (ITEMS, "200", "DeleteFirstItem", ITEM_DELETE, first_item),
        (ITEM_DELETE, "200", "TheItems", ITEMS, cid),
        (ITEM_DELETE, "200", "DeleteTheConversation", CONVERSATION_DELETE, cid),
        (CONVERSATION_UPDATE, "200", "AddItems", ITEMS_ADD, cid),
        (CONVERSATION_DELETE, "200", "ReadItAgain", CONVERSATION, cid),
        (LIST_USERS, "200", "EraseTheFirst", ERASE_USER, {"parameters": {"path.user_id": FIRST_ID}}),
        (ERASE_USER, "200", "TheUsers", LIST_USERS, {}),
    ]


def add_links(schema: dict[str, Any]) -> int:
    """Add the links to a fetched schema (in place); returns how many were added."""
    paths = schema["paths"]
    ids = {
        (m, p): op["operationId"] for p, ops in paths.items() for m, op in ops.items() if "operationId" in op
    }
    added = 0
    for src, status, name, dst, spec in _links() + _conversation_links():
        if src not in ids or dst not in ids:
            print(f"warning: no operation {src if src not in ids else dst}; link {name} skipped", flush=True)
            continue
        response = paths[src[1]][src[0]].setdefault("responses", {}).setdefault(status, {"description": ""})
        response.setdefault("links", {})[name] = {"operationId": ids[dst], **spec}
        added += 1
    return added
