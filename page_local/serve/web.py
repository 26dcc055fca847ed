"""The web UI: a chat page served by `page-local serve` at GET /, from files shipped in the package
(page_local/serve/web/). Plain JavaScript and CSS, no build step and nothing fetched from another
site: the page works offline, on a machine that cannot reach a CDN, and what it runs is what the
package ships (docs/serve.md, "The web UI").

    GET /                 the page (index.html)
    GET /ui/{name}        its script, style sheet, and config.json (the gate modes, evictors and on_full
                          policies the server accepts, for the settings' menus)

No key is needed for these (guards.KeyGuard: a browser cannot send one with a navigation, and they
hold no secret); the page sends the key with its API calls. Every answer carries a Content-Security-
Policy that allows scripts and styles from this origin only and no inline script, so that even a
model answer that reached the DOM as HTML could not run (the page never does that: it builds nodes
with textContent).
"""

from __future__ import annotations

import json
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent / "web"
FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "markdown.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def config() -> dict:
    """What the page's settings offer: the names the server's `page_local` request fields accept."""
    from page_local.engine.room import ON_FULL
    from page_local.evictors import EVICTORS
    from page_local.gate import GATE_MODES

    return {"gates": list(GATE_MODES), "evictors": sorted(EVICTORS), "on_full": list(ON_FULL)}


def routes() -> list:
    """Starlette routes for the page and its files."""
    from starlette.responses import Response
    from starlette.routing import Route

    from page_local.serve.errors import ApiError

    def file_response(name: str):
        try:
            body = (WEB_DIR / name).read_bytes()
        except OSError as e:  # an installation without the page's files
            raise ApiError(404, f"the web UI's file {name} is not installed ({e.strerror}); reinstall page-local",
                           "not_found") from None
        return Response(body, media_type=FILES[name], headers=HEADERS)

    async def index(request):
        return file_response("index.html")

    async def asset(request):
        name = request.path_params["name"]
        if name == "config.json":
            return Response(json.dumps(config()), media_type="application/json", headers=HEADERS)
        if name not in FILES:
            raise ApiError(404, f"no file {name!r} in the web UI; it has {', '.join(sorted(FILES))}", "not_found")
        return file_response(name)

    return [Route("/", index, methods=["GET", "HEAD"]), Route("/ui/{name}", asset, methods=["GET", "HEAD"])]
