"""/docs (Swagger UI) and /redoc (ReDoc) load nothing from another site: each page names no
absolute http(s) URL, and every asset it references (scripts, styles, favicon, the OpenAPI
document, Swagger's OAuth2 redirect page) answers 200 from this server without an API key."""

from __future__ import annotations

import re

import pytest

# src="…" / href="…" attributes, and the quoted same-site URLs the inline scripts hand to the UIs
_REFERENCE = re.compile(
    r"""(?:src|href|spec-url)=["']([^"']+)["']|(?:url|oauth2RedirectUrl)\s*:[^'"\n]*['"]([^'"]+)['"]"""
)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_page_and_every_asset_load_from_this_server(fake, page):
    r = await fake.http.get(page, headers={"Authorization": ""})  # public, like /openapi.json
    assert r.status_code == 200, r.text
    html = r.text
    assert "http://" not in html and "https://" not in html, html
    refs = {a or b for a, b in _REFERENCE.findall(html)}
    scripts = {ref for ref in refs if ref.endswith(".js")}
    assert scripts, f"{page} references no script: {html}"
    assert "/openapi.json" in refs, refs
    assert any(ref.endswith(".png") for ref in refs), f"{page} has no local favicon: {refs}"
    for ref in refs:
        assert ref.startswith("/"), ref
        got = await fake.http.get(ref, headers={"Authorization": ""})
        assert got.status_code == 200, (ref, got.status_code, got.text[:200])
        assert got.content, ref
    if page == "/docs":
        assert any(ref.endswith(".css") for ref in refs), refs
        assert "/docs/oauth2-redirect" in refs, refs
