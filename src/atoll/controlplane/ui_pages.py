"""The dashboard at /ui: one HTML page and its assets (atoll.ui's `static/`, built from ui/ by
`make ui`), served by this server with no key, like /docs; the page signs in with an API key that
it keeps in the browser's sessionStorage and sends on every API call it makes.

Every asset comes from this server (no CDN, no web font, no absolute URL in the pages), so the
dashboard works offline. Called by controlplane.app (create_app), which calls `install` and lets
`is_public` paths through its auth middleware.
"""

from __future__ import annotations

import pathlib

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

UI = "/ui"
ASSETS = "/ui/assets"
FAVICON = "/favicon.ico"  # browsers ask for it whatever the page says: answered, not a 404
STATIC_DIR = pathlib.Path(__file__).resolve().parents[1] / "ui" / "static"
# The page may load only what this server serves; the API is reached with fetch and WebSockets.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def is_public(path: str) -> bool:
    """True for the page, its assets and the favicon (app's auth middleware lets them through)."""
    return path in (UI, UI + "/", FAVICON) or path.startswith(ASSETS + "/")


def install(app: FastAPI) -> None:
    """Adds /ui, its asset mount and /favicon.ico to `app`."""
    app.mount(ASSETS, StaticFiles(directory=STATIC_DIR, check_dir=False), name="ui-assets")

    @app.get(UI, include_in_schema=False)
    async def page() -> Response:
        index = STATIC_DIR / "index.html"
        if not index.is_file():
            return Response(
                "the dashboard's assets are not built: run `make ui`",
                status_code=404,
                media_type="text/plain",
            )
        return FileResponse(
            index,
            media_type="text/html",
            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP},
        )

    @app.get(UI + "/", include_in_schema=False)
    async def page_slash() -> Response:
        return RedirectResponse(UI, status_code=308)

    @app.get(FAVICON, include_in_schema=False)
    async def favicon() -> Response:
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")
