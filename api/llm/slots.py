"""Generation slots: a bounded number of generations at once, and a bounded share for one user.

Beyond the limit a request gets `EngineOverloaded` (503 with Retry-After) instead of waiting in an
unbounded queue; a user who holds `per_user` slots already gets `UserSlotsExhausted` (429 with
Retry-After), so that one user's burst cannot take every slot from the others. A request takes
its slot on arrival (`admit`), before any work and before its response starts, streaming or not;
its generation then adopts that slot (`admitted`). One event loop runs every request: no lock is
needed between a check and its increment.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from api.http_errors import EngineOverloaded, UserSlotsExhausted


@dataclass(eq=False)
class Slot:
    """A generation slot taken by `GenerationSlots.admit` for one request; `release` gives it
    back (once, however often it is called)."""

    slots: GenerationSlots
    user: str | None = None  # whose share it counts in (`admit`)
    adopted: bool = False  # a generation of the request runs in it (`GenerationSlots.admitted`)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.release_one(self.user)


# The slot of the request being answered: set by `admit` in the route, read by the generation
# that follows in the same request, also from the task a streaming response runs its body in
# (tasks start with a copy of their creator's context).
_HELD: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("dss_admission_slot", default=None)


class GenerationSlots:
    def __init__(self, limit: int, retry_after_s: int, per_user: int | None = None) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.per_user = limit if per_user is None else max(1, min(per_user, limit))
        self.inflight = 0
        self.held_by: dict[str, int] = {}  # user -> slots taken by `admit` and not given back
        self.on_change: Callable[[int], object] | None = None  # set by the app: a gauge setter

    def admit(self, user: str | None = None) -> Slot:
        """Take a generation slot for the request being answered, for `user` (counted in their
        share), now, or fail with `UserSlotsExhausted` (429, Retry-After) when the user holds
        their share already, else `EngineOverloaded` (503, Retry-After) when none is free.
        Counted from here on, before the response starts: a stream counted only once its body
        began let a whole burst past the limit. The request's
        generation (in this context) then uses this slot: `check_capacity` passes, `admitted`
        adopts it and gives it back when the generation ends; the caller releases it as well
        (idempotent), for the requests that end before they generate."""
        if user is not None and self.held_by.get(user, 0) >= self.per_user:
            raise UserSlotsExhausted(
                f"this user already runs {self.per_user} generations, the most one user may run at "
                "once; retry when one ends",
                self.retry_after_s,
            )
        self._check_free()
        slot = Slot(self, user)
        self._take()
        if user is not None:
            self.held_by[user] = self.held_by.get(user, 0) + 1
        _HELD.set(slot)
        return slot

    def check_capacity(self) -> None:
        """Fail fast with `EngineOverloaded` when every generation slot is taken (a request that
        holds one from `admit` passes)."""
        if self._held() is None:
            self._check_free()

    @contextlib.asynccontextmanager
    async def admitted(self, strict: bool = True) -> AsyncIterator[None]:
        """Hold a generation slot: the one this request took with `admit`, else a new one.
        `strict`: fail with `EngineOverloaded` when none is free; otherwise take it anyway (a
        stream whose capacity was checked before its 200 went out)."""
        held = self._held()
        if held is not None and not held.adopted:
            held.adopted = True
            try:
                yield
            finally:
                held.release()
            return
        if strict:
            self._check_free()
        self._take()
        try:
            yield
        finally:
            self.release_one()

    def release_one(self, user: str | None = None) -> None:
        self.inflight -= 1
        if user is not None:
            left = self.held_by.get(user, 0) - 1
            if left > 0:
                self.held_by[user] = left
            else:
                self.held_by.pop(user, None)
        self._report()

    def _take(self) -> None:
        self.inflight += 1
        self._report()

    def _check_free(self) -> None:
        if self.inflight >= self.limit:
            raise EngineOverloaded(
                f"{self.inflight} generations are running, the limit is {self.limit}; retry shortly",
                self.retry_after_s,
            )

    def _held(self) -> Slot | None:
        slot = _HELD.get()
        return slot if slot is not None and slot.slots is self and not slot.released else None

    def _report(self) -> None:
        if self.on_change is not None:
            self.on_change(self.inflight)
