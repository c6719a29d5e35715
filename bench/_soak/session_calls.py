"""A soak client's session routes: create, rollback, branch, delete, `PATCH` retention hints,
warm-ups, the listing routes, the online read of a session's versions, and `resync` (re-reading a
session whose state is uncertain; it never adds to the ledger)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import MAX_BRANCHES, Sess

if TYPE_CHECKING:
    from .client import Client


class SessionCalls:
    """A client's calls on its sessions (everything but turns and responses)."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.ctl, self.rec, self.rng = client.ctl, client.rec, client.rng

    def browse(self) -> None:
        """The listing routes: sessions, one session, its branches, models, public prefixes."""
        listed = self.c.req("browse", "GET", "/v1/sessions?limit=50").json()
        if not isinstance(listed.get("data"), list):
            self.rec.count("unexpected")
        if self.c.sessions:
            s = self.rng.choice(sorted(self.c.sessions.values(), key=lambda x: x.sid))
            self.c.req("browse", "GET", f"/v1/sessions/{s.sid}/branches")
        self.c.req("browse", "GET", "/v1/models")
        self.c.req("browse", "GET", "/v1/prefixes")

    def patch(self) -> None:
        if not self.c.sessions:
            return
        s = self.rng.choice(sorted(self.c.sessions.values(), key=lambda x: x.sid))
        body: dict[str, Any] = {
            "kv_retention": self.rng.choice(["normal", "evict", "pinned", "normal"]),
            "kv_idle_ttl_s": self.rng.choice([None, 5, 600]),
        }
        # A pinned session beyond the pinned cap is a documented 409.
        r = self.c.req("patch", "PATCH", f"/v1/sessions/{s.sid}", body, expect=(200, 409))
        if r.status_code == 409 and "pinned_cap_exceeded" not in r.text:
            self.c.check_status("patch", r.status_code, r.text, (200,))

    def warm(self) -> None:
        options = [(s, b) for s in self.c.sessions.values() for b in s.branches]
        if not options:
            return
        s, b = self.rng.choice(sorted(options, key=lambda x: (x[0].sid, x[1])))
        self.c.req("warm", "POST", f"/v1/sessions/{s.sid}/warm", {"branch": b}, expect=(202,))

    def create(self) -> None:
        s = self.c.new_session(stored=True)
        s.dirty = True
        self.c.req("create", "POST", "/v1/sessions", {"session_id": s.sid, "system_prompt": s.system}, (201,))
        s.dirty = self.c.raced()

    def rollback(self) -> None:
        options = [(s, b, h) for s in self.c.sessions.values() for b, h in s.branches.items() if h > 0]
        if not options:
            return
        s, branch, head = self.rng.choice(options)
        chain, v = [], head
        while v is not None and v in s.parents:
            chain.append(v)
            v = s.parents[v]
        if not chain:
            return
        to = self.rng.choice(chain)
        s.dirty = True
        r = self.c.req(
            "rollback",
            "POST",
            f"/v1/sessions/{s.sid}/rollback",
            {"to_version": to, "branch": branch, "expected_head": head},
        )
        if r.json().get("head_version") != to:
            self.rec.count("unexpected")
            self.rec.event("rollback_wrong_head", user=self.c.user, asked=to, got=r.json())
        s.branches[branch] = to
        s.dirty = self.c.raced()
        self.rec.count("rollbacks")

    def branch(self) -> None:
        options = [
            (s, n) for s in self.c.sessions.values() for n in s.known if len(s.branches) < MAX_BRANCHES
        ]
        if not options:
            return
        s, n = self.rng.choice(options)
        s.n_branches += 1
        name = f"alt-{s.n_branches}"
        s.dirty = True
        self.c.req(
            "branch", "POST", f"/v1/sessions/{s.sid}/branches", {"from_version": n, "name": name}, (201,)
        )
        s.branches[name] = n
        s.dirty = self.c.raced()
        self.rec.count("branches")

    def read(self) -> None:
        """List a session's versions: every acknowledged one must be there (an online check)."""
        sids = sorted({sid for sid, _ in self.c.ledger})
        if not sids:
            return
        sid = self.rng.choice(sids)
        listed: set[int] = set()
        after = 0
        while True:  # the listing comes in pages of limits.max_list_limit
            page = self.c.req("read", "GET", f"/v1/sessions/{sid}/versions?after={after}").json()
            listed |= {v["number"] for v in page["data"]}
            if not page["has_more"]:
                break
            after = int(page["last_id"])
        for (lsid, n), e in list(self.c.ledger.items()):
            if lsid == sid and n not in listed:
                self.ctl.verifier.lost(self.c, e, "not listed (online read)", {"listed": sorted(listed)})

    def delete_random(self) -> None:
        if self.c.sessions:
            self.delete(self.rng.choice(sorted(self.c.sessions)))

    def delete(self, sid: str) -> None:
        self.c.pending_delete.add(sid)
        self.c.req("delete", "DELETE", f"/v1/sessions/{sid}", expect=(200, 404))
        self.c.pending_delete.discard(sid)
        gone = self.c.sessions.pop(sid, None)
        if gone is not None:
            self.c.deleted_markers.append(gone.marker)
        for k in [k for k in self.c.ledger if k[0] == sid]:
            del self.c.ledger[k]
        self.rec.count("deletes")

    def resync(self, s: Sess, ghost_from: int | None = None) -> None:
        """Re-read a session whose state is uncertain (never adds to the ledger)."""
        r = self.c.req("resync", "GET", f"/v1/sessions/{s.sid}", expect=(200, 404))
        if r.status_code == 404:
            entries = [e for (sid, _), e in self.c.ledger.items() if sid == s.sid]
            for e in entries:
                self.ctl.verifier.lost(self.c, e, "session gone (resync)", {})
            self.c.sessions.pop(s.sid, None)
            return
        info = r.json()
        count = int(info["version_count"])
        if ghost_from is not None and count > ghost_from and not self.c.raced():
            self.rec.count("ghost_commits", count - ghost_from)
        s.vcount = max(s.vcount, count)
        s.branches = {b["name"]: int(b["head_version"]) for b in info["branches"]}
        for head in set(s.branches.values()):
            if head > 0 and head not in s.known:
                v = self.c.req("resync", "GET", f"/v1/sessions/{s.sid}/versions/{head}").json()
                s.known[head] = v["messages"]
                s.parents[head] = v["parent"]
        s.dirty = False
