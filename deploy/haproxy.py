"""The cluster's router: deploy/haproxy.cfg filled in for the cluster's servers, checked by
`haproxy -c`, and the haproxy executable (installed with apt-get when missing and allowed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from deploy.spec import LOOPBACK, ClusterError, ServerSpec

TEMPLATE = Path(__file__).with_name("haproxy.cfg")


# What an HTTP header name may be here (RFC 9110's token, less what HAProxy's syntax gives a meaning).
_HEADER_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")


def session_header_lines(names: Sequence[str]) -> str:
    """One line per frontend session header (a frontend key's `session_header` in DSS): the router
    reads the session id from it when no header before it in the template named one."""
    lines = []
    for name in names:
        if _HEADER_NAME.fullmatch(name) is None:
            raise ClusterError(f"not a header name for the router: {name!r} (letters, digits, '-', '_')")
        unset = "!{ var(txn.dss_session) -m found }"
        lines.append(f"    http-request set-var(txn.dss_session) req.hdr({name}) if {unset}")
    return "\n".join(lines) or "    # (no frontend session headers: deploy/cluster.py --session-header)"


def render_haproxy_config(
    servers: Sequence[ServerSpec],
    port: int,
    check_interval_ms: int = 1000,
    template: Path = TEMPLATE,
    session_headers: Sequence[str] = (),
) -> str:
    """deploy/haproxy.cfg with its markers filled in: the bind address, the check interval, one
    `server` line per server (with its fixed `id`, see the template), one line per frontend
    session header the router reads a session id from."""
    lines = [f"    server {s.name} {LOOPBACK}:{s.port} id {s.number} check" for s in servers]
    text = template.read_text()
    for marker, value in (
        ("@@bind@@", f"{LOOPBACK}:{port}"),
        ("@@check_inter@@", f"{check_interval_ms}ms"),
        ("@@session_headers@@", session_header_lines(session_headers)),
        ("@@servers@@", "\n".join(lines)),
    ):
        if marker not in text:
            raise ClusterError(f"{template} has no {marker} marker")
        text = text.replace(marker, value)
    return text


def ensure_haproxy(install: bool = True) -> str:
    """The haproxy executable; when it is missing, installed from the distribution's packages
    (as root, with apt-get), else a `ClusterError` that says how to install it."""
    found = _which_haproxy()
    if found is not None:
        return found
    how = "install it with `sudo apt-get install haproxy` (Debian, Ubuntu) or your system's package manager"
    if not install:
        raise ClusterError(f"haproxy is not installed; {how}")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterError(f"haproxy is not installed and this user cannot install it; {how}")
    print("haproxy is not installed; installing it with apt-get (Debian's haproxy package)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "haproxy"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise ClusterError(f"`{' '.join(cmd)}` failed; {how}:\n" + "\n".join(tail))
    found = _which_haproxy()
    if found is None:
        raise ClusterError(f"apt-get installed haproxy but it is not on PATH; {how}")
    return found


def _which_haproxy() -> str | None:
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):  # sbin is not on every user's PATH
        found = "/usr/sbin/haproxy"
    return found


def check_haproxy_config(haproxy: str, config: Path) -> None:
    done = subprocess.run(
        [haproxy, "-c", "-q", "-f", str(config)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"haproxy refuses {config}:\n{(done.stdout + done.stderr).strip()}")
