"""The path of one chat turn through the API, measured: which modules of `api/` and
`dss/dialogue/` it passes through, how often it re-enters one, how often the request limits are
checked and how often vLLM validates the request.

Runs the app in-process (dev mode, a fresh data directory) with the real engine, sends one
warm-up session turn, then profiles the second turn of that session (a continuation, the common
case) with `sys.setprofile`, also in the worker threads the turn's blocking steps run in:

    .venv/bin/python bench/turn_path.py [--stream]

prints `RESULT modules=N reentries=M upcalls=U check_limits=K vllm_validations=V` and the module
sequence. A module is entered when a call begins (not when a generator resumes) in it while the
previous call that began in a measured module was in another one; `reentries` counts every entry
after a module's first. `upcalls` counts the calls that climb back into a module still on the
call stack below the caller (a callback: `api.a` -> `dss.b` -> `api.a`), where `reentries` also
counts a module that calls two others in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MEASURED = ("api.", "dss.dialogue.")
LIMIT_CHECKS = {"check_limits", "check_turn_limits"}


class PathProfile:
    def __init__(self) -> None:
        self.active = False
        self.seen: set[FrameType] = set()
        self.sequence: list[str] = []
        self.upcalls: Counter[str] = Counter()
        self.limit_checks = 0
        self.validations = 0
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        with self._lock:
            if frame in self.seen:
                return  # a generator or coroutine resumed, not a new call
            self.seen.add(frame)
            module = str(frame.f_globals.get("__name__", ""))
            code = frame.f_code
            if module.startswith(MEASURED):
                if code.co_name in LIMIT_CHECKS:
                    self.limit_checks += 1
                if not self.sequence or self.sequence[-1] != module:
                    self.sequence.append(module)
                self._note_upcall(frame, module)
            elif code.co_name == "model_validate" and module == "pydantic.main":
                cls = frame.f_locals.get("cls")
                if cls is not None and str(getattr(cls, "__module__", "")).startswith("vllm."):
                    self.validations += 1

    def _note_upcall(self, frame: FrameType, module: str) -> None:
        caller = frame.f_back
        if caller is None or caller.f_globals.get("__name__") == module:
            return
        below = caller.f_back
        for _ in range(256):
            if below is None:
                return
            if below.f_globals.get("__name__") == module:
                outer = str(caller.f_globals.get("__name__", ""))
                self.upcalls[f"{module} <- {outer}"] += 1
                return
            below = below.f_back


def environment(data_dir: Path, model: Path) -> None:
    os.environ.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "DSS_ENGINE__MODEL": str(model),
            "DSS_ENGINE__MAX_MODEL_LEN": "2048",
            "DSS_ENGINE__KV_CACHE_SPACE_GIB": "1",
            "DSS_LIMITS__DEFAULT_MAX_TOKENS": "8",
            "DSS_STORE__DATA_DIR": str(data_dir),
            "DSS_STORE__HOST_CAPACITY_BYTES": str(256 << 20),
            "DSS_STORE__DISK_CAPACITY_BYTES": str(2 << 30),
            "DSS_STORE__FSYNC": "false",
            "DSS_AUTH__DEV_MODE": "true",
        }
    )


async def run(stream: bool, profile: PathProfile) -> None:
    import httpx

    from api.app import create_app

    app = create_app()
    headers = {"X-DSS-User": "alice"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            for _ in range(3000):
                if (await c.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("the engine did not become ready")
            first = [{"role": "user", "content": "Name a colour."}]
            body = {"messages": first, "session_id": "path", "max_tokens": 8, "temperature": 0}
            r = await c.post("/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()
            answer = r.json()["choices"][0]["message"]
            second = [*first, {"role": "assistant", "content": answer["content"]}]
            second.append({"role": "user", "content": "And another."})
            body = {**body, "messages": second, "stream": stream}
            # Fresh worker threads carry the profile (threading.setprofile covers new threads only).
            threading.setprofile(profile)
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
            sys.setprofile(profile)
            profile.active = True
            try:
                r = await c.post("/v1/chat/completions", json=body, headers=headers)
                text = r.text
            finally:
                profile.active = False
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            if r.status_code != 200 or "error" in text[:200]:
                raise SystemExit(f"the turn failed: {r.status_code} {text[:500]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", action="store_true", help="profile a streamed turn")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.api_server import model_dir

    model = model_dir()
    if model is None:
        raise SystemExit("no model: set DSS_MODEL_DIR or run `make model`")
    profile = PathProfile()
    with tempfile.TemporaryDirectory(prefix="dss-turn-path-") as tmp:
        environment(Path(tmp), model)
        asyncio.run(run(args.stream, profile))
    entries = Counter(profile.sequence)
    print("path:", " -> ".join(profile.sequence))
    for module, n in entries.most_common():
        print(f"  {n:3d}  {module}")
    reentries = sum(n - 1 for n in entries.values())
    for edge, n in profile.upcalls.most_common():
        print(f"  upcall {n:3d}  {edge}")
    print(
        f"RESULT modules={len(entries)} reentries={reentries} upcalls={sum(profile.upcalls.values())} "
        f"check_limits={profile.limit_checks} vllm_validations={profile.validations}"
    )


if __name__ == "__main__":
    main()
