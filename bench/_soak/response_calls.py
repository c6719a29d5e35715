"""A soak client's Responses API calls: `POST /v1/responses` (new chains, continuations, forks,
`store: false`), `GET` a response and its input items, `DELETE` (with `cascade=true` for a
response others continue)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .calls import Ambiguous
from .model import MAX_DEPTH, Resp

if TYPE_CHECKING:
    from .client import Client


class ResponseCalls:
    """A client's stored responses, kept in `Client.responses` and its ledger."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.ctl, self.rec, self.rng = client.ctl, client.rec, client.rng

    def respond(self) -> None:
        """POST /v1/responses: a new chain, its continuation, or a fork at an older response;
        streamed or not; now and then `store: false` (nothing may be kept)."""
        r = self.rng
        prev = r.choice(sorted(self.c.responses.values(), key=lambda x: x.id)) if self.c.responses else None
        if prev is not None and (r.random() < 0.25 or prev.version >= MAX_DEPTH // 2):
            prev = None
        store = r.random() > 0.1
        stream = r.random() < 0.35
        text_in = self.c.user_text()
        body: dict[str, Any] = {
            "model": "default",
            "input": text_in,
            "instructions": "Answer in a few words.",
            "max_output_tokens": r.choice([4, 6, 8]),
            "temperature": 0,
            "store": store,
        }
        if prev is not None:
            body["previous_response_id"] = prev.id
        if stream:
            body["stream"] = True
            out_text, ev = self.c.stream_request(
                "response_stream", "/v1/responses", body, lambda e: e.get("type") == "response.completed"
            )
            data = ev.get("response") or {}
        else:
            data = self.c.req("response", "POST", "/v1/responses", body).json()
            out_text = data.get("output_text") or "".join(
                p.get("text", "") for o in data.get("output") or [] for p in o.get("content") or []
            )
        q = self.c.last_q
        dss = data.get("dss") or {}
        rid = data.get("id")
        if not store:
            self.rec.count("responses_unstored")
            if isinstance(rid, str):  # nothing kept: not even the record
                with contextlib.suppress(Ambiguous):
                    self.c.req("response_read", "GET", f"/v1/responses/{rid}", expect=(404,))
            return
        if not isinstance(rid, str) or not isinstance(dss.get("session_id"), str):
            self.rec.count("unexpected")
            self.rec.event("response_without_record", user=self.c.user, data=str(data)[:1000])
            return
        fields = {
            "state_version": dss.get("version"),
            "branch": dss.get("branch"),
            "session_id": dss.get("session_id"),
            "parent_version": prev.version if prev is not None and prev.sid == dss["session_id"] else None,
        }
        via = "response_stream" if stream else "response"
        entry = self.c.acked(None, fields, None, via, None, q, text=out_text, response_id=rid)
        if entry is not None:
            self.c.responses[rid] = Resp(rid, entry.sid, entry.number, q)
            if prev is not None and prev.id in self.c.responses:
                self.c.responses[prev.id].children += 1
            self.rec.count("responses_stored")

    def response_read(self) -> None:
        if not self.c.responses:
            return
        resp = self.rng.choice(sorted(self.c.responses.values(), key=lambda x: x.id))
        r = self.c.req("response_read", "GET", f"/v1/responses/{resp.id}")
        if r.json().get("id") != resp.id:
            self.rec.count("unexpected")
            self.rec.event("response_read_other", user=self.c.user, asked=resp.id, got=r.text[:500])
        order = self.rng.choice(["asc", "desc"])
        items = self.c.req(
            "response_items", "GET", f"/v1/responses/{resp.id}/input_items?order={order}&limit=5"
        )
        if not isinstance(items.json().get("data"), list):
            self.rec.count("unexpected")

    def response_delete(self) -> None:
        """DELETE a leaf response (200), or an inner one with `cascade=true`."""
        if not self.c.responses:
            return
        resp = self.rng.choice(sorted(self.c.responses.values(), key=lambda x: x.id))
        cascade = resp.children > 0
        path = f"/v1/responses/{resp.id}" + ("?cascade=true" if cascade else "")
        body = self.c.req("response_delete", "DELETE", path).json()
        gone = set(body.get("deleted_response_ids") or []) | {resp.id}
        for rid in gone:
            old = self.c.responses.pop(rid, None)
            if old is not None:
                self.c.ledger.pop((old.sid, old.version), None)
        for sid, n in [k for k, e in self.c.ledger.items() if e.response_id in gone]:
            del self.c.ledger[(sid, n)]
        self.rec.count("response_deletes")
