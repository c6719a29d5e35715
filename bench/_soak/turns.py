"""A soak client's turns: chat completions (greedy, streamed or not, `n` = 2 alternatives) through
the official `openai` client, stateful `/messages` turns, streams dropped after two chunks (nothing
may be committed), and the cold replay that judges a greedy answer (`CORRUPT_MARGIN`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx

from .calls import first_divergence, sse
from .model import Messages, Sess

if TYPE_CHECKING:
    from .client import Client

# Nats by which a cold recompute may prefer its token over the one served at the first point
# where they differ, before the difference is not rounding any more (bf16 on CPU moves a
# 135M model's logits by a few tenths at most between batch compositions).
CORRUPT_MARGIN = 1.5


class Turns:
    """A client's generation turns; every acknowledged version goes through `Client.acked`."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.ctl, self.rec, self.rng = client.ctl, client.rec, client.rng

    def chat(self, s: Sess, head: int, stream: bool, n: int = 1) -> None:
        sent = [*s.base(head), {"role": "user", "content": self.c.user_text(s)}]
        max_tokens = self.rng.choice([6, 8, 12, 16])
        kind = ("chat_stream" if stream else "chat") + ("_n" if n > 1 else "")
        # n > 1 samples (siblings would be identical greedily); a single answer is greedy and,
        # not streamed, carries log-probs for the cold recompute (`greedy_replay`).
        if n > 1 and self.ctl.alt_seed:
            extra_seed: dict[str, Any] = {"seed": self.c.counter}
        else:
            extra_seed = {}
        sampling: dict[str, Any] = extra_seed | ({"temperature": 0} if n == 1 else {"temperature": 1.0})
        s.dirty = True  # until acknowledged
        if not stream:
            resp = self.c.openai_call(
                kind,
                lambda: self.c.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    n=n,
                    logprobs=n == 1,
                    top_logprobs=5 if n == 1 else None,
                    extra_body={"session_id": s.sid},
                    **sampling,
                ),
            )
            q = self.c.last_q
            data = dict(resp.model_extra or {})
            choices = [(c.message.content or "", dict(c.model_extra or {}), c.logprobs) for c in resp.choices]
            usage = resp.usage.prompt_tokens if resp.usage is not None else None
        else:

            def consume() -> tuple[dict[int, str], dict[int, dict[str, Any]], dict[str, Any]]:
                parts: dict[int, list[str]] = {}
                per_choice: dict[int, dict[str, Any]] = {}
                fields: dict[str, Any] = {}
                for chunk in self.c.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    n=n,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"session_id": s.sid},
                    **sampling,
                ):
                    extra = chunk.model_extra or {}
                    if extra.get("state_version") is not None:
                        fields = dict(extra)
                    for ch in chunk.choices:
                        if ch.delta.content:
                            parts.setdefault(ch.index, []).append(ch.delta.content)
                        if (ch.model_extra or {}).get("state_version") is not None:
                            per_choice[ch.index] = dict(ch.model_extra or {})
                return {i: "".join(p) for i, p in parts.items()}, per_choice, fields

            texts, per_choice, data = self.c.openai_call(kind, consume)
            q = self.c.last_q
            choices = [(texts.get(i, ""), per_choice.get(i, {}), None) for i in range(n)]
            usage = None
        for i, (text, extra, _) in enumerate(choices):
            messages = [*sent, {"role": "assistant", "content": text}]
            if extra.get("state_version") is not None:
                self.c.acked(s, {**data, **extra}, messages, kind, head, q)
            elif i == 0:
                self.c.acked(s, data, messages, kind, head, q)
            else:  # an alternative without its own version: the docs promise one
                self.rec.count("unexpected")
                self.rec.event("alternative_without_version", user=self.c.user, index=i, data=str(data)[:500])
        if not self.c.raced():
            s.dirty = False
        if not stream and n == 1 and self.rng.random() < self.ctl.replay_fraction:
            self.greedy_replay(sent, max_tokens, choices[0][0], data, choices[0][2], usage)

    def greedy_replay(
        self,
        sent: Messages,
        max_tokens: int,
        text: str,
        data: dict[str, Any],
        logprobs: Any,
        prompt_tokens: int | None,
    ) -> None:
        """The same messages as a plain request of another user (its own namespace: a cold
        prefill), greedy: the same text? Where not, the first differing token decides: a cold run
        that preferred its token by more than `CORRUPT_MARGIN` nats over the one served is not
        rounding (batch composition moves logits by far less): `corrupt_answers`."""
        body = {
            "model": "default",
            "messages": sent,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
        }
        r = self.c.req("replay", "POST", "/v1/chat/completions", body, client=self.c.replay).json()
        choice = r["choices"][0]
        other = choice["message"]["content"]
        dss = data.get("dss") or {}
        loaded = int(dss.get("loaded_tokens") or 0)  # read from a DSS tier by the connector
        cached = int(dss.get("cached_tokens") or 0)  # not computed: DSS or vLLM's own prefix cache
        self.rec.count("greedy_checked")
        self.rec.count("greedy_checked_cached", 1 if cached else 0)
        self.rec.count("greedy_checked_loaded", 1 if loaded else 0)
        if other == text:
            return
        self.rec.count("greedy_mismatch")
        self.rec.count("greedy_mismatch_cached", 1 if cached else 0)
        self.rec.count("greedy_mismatch_loaded", 1 if loaded else 0)
        ours = [t.model_dump() for t in (logprobs.content or [])] if logprobs is not None else []
        cold = list((choice.get("logprobs") or {}).get("content") or [])
        cold_prompt = int((r.get("usage") or {}).get("prompt_tokens") or 0)
        if prompt_tokens is not None and cold_prompt != prompt_tokens:
            # The session's prompt is its stored ids: where they do not tokenize back from the
            # text, the two prompts differ and so may the answers.
            self.rec.count("greedy_prompt_differs")
            return
        div = first_divergence(ours, cold)
        where = {"session": text, "cold": other, "dss": dss}
        if div is None:
            self.rec.event("greedy_mismatch", keep=10, **where, note="no token-level divergence")
            return
        pos, cold_margin, our_margin = div
        if cold_margin > CORRUPT_MARGIN:
            self.rec.count("corrupt_answers")
            self.rec.event(
                "corrupt_answer",
                user=self.c.user,
                position=pos,
                cold_margin=cold_margin,
                served_margin=our_margin,
                messages=sent[-2:],
                **where,
            )
        else:
            self.rec.event(
                "greedy_mismatch", keep=10, position=pos, cold_margin=round(cold_margin, 3), **where
            )

    def message(self, s: Sess, branch: str, head: int, stream: bool) -> None:
        content = self.c.user_text(s)
        body = {
            "content": content,
            "branch": branch,
            "max_tokens": self.rng.choice([6, 8, 12]),
            "temperature": 0,
            "stream": stream,
        }
        path = f"/v1/sessions/{s.sid}/messages"
        s.dirty = True
        if not stream:
            data = self.c.req("message", "POST", path, body).json()
            text = data["choices"][0]["message"]["content"]
        else:
            text, data = self.c.stream_request(
                "message_stream", path, body, lambda ev: ev.get("state_version") is not None
            )
        q, raced = self.c.last_q, self.c.raced()
        parent = data.get("parent_version")
        if not raced and parent is not None and parent not in s.known:
            self.c.session_calls.resync(s)  # the client did not know that version: read it back
        base = s.root() if parent is None else s.known.get(parent)
        if base is None:
            if not raced:
                self.rec.count("unexpected")
                self.rec.event("unknown_parent", user=self.c.user, session=s.sid, data=str(data)[:500])
            return
        if data.get("branch") != branch:
            self.rec.count("unexpected")
            self.rec.event("message_wrong_branch", user=self.c.user, asked=branch, got=data.get("branch"))
        messages = [*base, {"role": "user", "content": content}, {"role": "assistant", "content": text}]
        self.c.acked(s, data, messages, "message_stream" if stream else "message", head, q)
        s.dirty = raced

    def disconnect(self, s: Sess, branch: str, head: int) -> None:
        """A stream the client drops after two content chunks: nothing should be committed."""
        before = s.vcount
        if head > 0 and self.rng.random() < 0.5:
            path = f"/v1/sessions/{s.sid}/messages"
            body: dict[str, Any] = {"content": self.c.user_text(s), "branch": branch, "stream": True}
        else:
            path = "/v1/chat/completions"
            sent = [*s.base(head), {"role": "user", "content": self.c.user_text(s)}]
            body = {"messages": sent, "session_id": s.sid, "stream": True}
        body.update({"max_tokens": 96, "temperature": 0})
        gen0, t0 = self.c.start_request()
        s.dirty = True
        chunks = 0
        try:
            with self.c.http_client(self.c.key) as c, c.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self.c.check_status("disconnect", resp.status_code, resp.text, (200,))
                for ev in sse(resp):
                    if isinstance(ev, dict) and any(
                        (ch.get("delta") or {}).get("content") for ch in ev.get("choices") or []
                    ):
                        chunks += 1
                    if chunks >= 2 or ev == "[DONE]" or (isinstance(ev, dict) and "error" in ev):
                        break
        except httpx.TimeoutException as exc:
            raise self.c.no_answer("disconnect", gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self.c.no_answer("disconnect", gen0, t0, exc, timeout=False) from None
        self.rec.count("disconnects")
        time.sleep(0.3)
        self.c.session_calls.resync(s, ghost_from=before)
