"""`GET /console`: the web console's static files (api/console/), served without a key.

The console is a static page: every data call it makes is the public REST API with the user's
own `Authorization: Bearer <key>`, so serving its files needs no auth and reveals nothing. Only
the three known files are served (no directory walk), each with a Content-Security-Policy that
allows scripts, styles and connections from this origin only (no inline script, no CDN).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from dss.errors import NotFoundError

router = APIRouter(tags=["console"], include_in_schema=False)

CONSOLE_DIR = Path(__file__).resolve().parent.parent / "console"
FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@router.get("/console")
def console_index() -> FileResponse:
    return _file("index.html")


@router.get("/console/", response_model=None)
def console_slash() -> RedirectResponse:
    return RedirectResponse("/console", status_code=307)


@router.get("/console/{name}")
def console_file(name: str) -> FileResponse:
    if name not in FILES:
        raise NotFoundError(f"no console file {name!r}")
    return _file(name)


def _file(name: str) -> FileResponse:
    return FileResponse(CONSOLE_DIR / name, media_type=FILES[name], headers=HEADERS)
