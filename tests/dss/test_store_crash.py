"""kill -9 a writer at random points during many commits; every reopen must recover cleanly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for

WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from tests.store_helpers import SMALL_FP, open_store, pages_for
    data_dir, round_no = sys.argv[1], int(sys.argv[2])
    store = open_store(__import__("pathlib").Path(data_dir), fsync=True)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("writer")
    sid = f"s{round_no}"
    store.versions.ensure_session("writer", sid)
    tokens = np.array([], dtype=np.int32)
    for v in range(1, 10_000):
        fresh = np.arange(v * 8, v * 8 + 8, dtype=np.int32) + round_no * 100_000
        tokens = np.concatenate([tokens, fresh])
        msgs = [{"role": "user", "content": str(v)}]
        info = store.versions.commit("writer", sid, tokens=tokens, messages=msgs)
        print(f"COMMITTED {sid} {info.number} {len(tokens)}", flush=True)
        put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
    """
)


def test_kill_9_during_commits_recovers(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    committed: dict[str, int] = {}
    rng = random.Random(1234)
    for round_no in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(data), str(round_no)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # wait until it is committing (imports take seconds)
        assert first.startswith("COMMITTED"), proc.stderr.read() if proc.stderr else first
        time.sleep(rng.uniform(0.05, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        for line in [first, *out.splitlines()]:
            if line.startswith("COMMITTED"):
                _, sid, number, _n = line.split()
                committed[sid] = max(committed.get(sid, 0), int(number))

        store = open_store(data)  # recovery: temp files, orphans, index rebuild, check()
        store.check()
        fid = store.fingerprints.register(SMALL_FP)
        tenant = store.identity.tenant_for("writer")
        for sid, last in committed.items():
            versions = store.versions.list_versions("writer", sid)
            numbers = [v.number for v in versions]
            assert numbers[:last] == list(range(1, last + 1)), f"{sid}: committed version lost"
            info = store.versions.get_version("writer", sid, last)
            tokens = info.tokens
            _n, got = load_sequence(store, fid, tenant, tokens)
            # whatever KV survived must be byte-exact; the rest is recomputed
            assert got == pages_for(SMALL_FP, np.asarray(tokens))[: len(got)]
        assert not list(data.rglob("*.tmp-*")), "half-written temp files must be collected"
        store.close()
