"""The API's browsable pages, /docs (Swagger UI) and /redoc (ReDoc), served with every asset from
this server: no CDN, no web font, no favicon from another site, so both work offline and behind
an egress-less firewall.

The JavaScript, CSS and favicon come from the pinned `fastapi-offline` package (its `static/`
folder: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png), mounted at
ASSETS; only its files are used, not its FastAPI factory. Called by controlplane.app (create_app),
which builds its FastAPI with docs_url=None and redoc_url=None and calls `install`.
"""

from __future__ import annotations

import pathlib

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
REDOC = "/redoc"
ASSETS = "/docs/assets"  # a prefix: everything under it is public, like the pages themselves
PAGES = frozenset({DOCS, OAUTH2_REDIRECT, REDOC})
STATIC_DIR = pathlib.Path(fastapi_offline.__file__).parent / "static"


def is_public(path: str) -> bool:
    """True for the pages and their assets (app's auth middleware lets them through)."""
    return path in PAGES or path.startswith(ASSETS + "/")


def install(app: FastAPI) -> None:
    """Adds the two pages, Swagger's OAuth2 redirect page and the asset mount to `app`."""
    app.mount(ASSETS, StaticFiles(directory=STATIC_DIR), name="docs-assets")

    def root(request: Request) -> str:
        return request.scope.get("root_path", "")

    @app.get(DOCS, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        base = root(request)
        return get_swagger_ui_html(
            openapi_url=base + (app.openapi_url or "/openapi.json"),
            title=app.title + " - Swagger UI",
            oauth2_redirect_url=base + OAUTH2_REDIRECT,
            swagger_js_url=f"{base}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{base}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{base}{ASSETS}/favicon.png",
            # validatorUrl None: Swagger UI would otherwise send the document to validator.swagger.io
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
        )

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        base = root(request)
        return get_redoc_html(
            openapi_url=base + (app.openapi_url or "/openapi.json"),
            title=app.title + " - ReDoc",
            redoc_js_url=f"{base}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{base}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
