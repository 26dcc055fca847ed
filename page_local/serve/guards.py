"""What a request must show before any route sees it: ASGI middleware over Starlette's own request
headers, outermost first (app.py installs them in this order):

    HostGuard    the Host header names this server (DNS rebinding: a page on evil.example that resolves
                 to 127.0.0.1 is "same origin" to the browser, but its requests say Host: evil.example)
    OriginGuard  a request that carries Origin (a browser's, from a web page) comes from an allowed
                 origin (--cors-origin) or from this server's own origin; Starlette's CORSMiddleware,
                 inside it, answers the allowed origins' preflights and adds their CORS headers
    KeyGuard     `Authorization: Bearer KEY` for one of the server's keys; the key's namespace
                 (which conversation cache the request may reuse) is put in the request's state
    JsonOnly     a POST declares `Content-Type: application/json` (or nothing)

Every refusal is an OpenAI error envelope (403, 401, 415) whose message says what to change. The
policies (HostPolicy, OriginPolicy) are plain objects, testable without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

from page_local.serve.errors import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
OPEN_PATHS = frozenset({"/health", "/v1/health"})  # what a launcher polls before it has a key to send
# the web UI's page and files (web.py): a browser cannot send a key with a navigation, and they hold no
# secret; the page then sends the key with its API calls (GET and HEAD only)
PAGE_PATHS = frozenset({"/"})
PAGE_PREFIX = "/ui/"
NO_KEY = ""  # the one namespace of a server without keys


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(value: str) -> str | None:
    """The name in a Host header value (`name`, `name:port`, `[v6]:port`), lowercase, without port,
    brackets or a trailing dot; None if the value is not a host (a path, a user, a bad port)."""
    value = value.strip()
    if not value:
        return None
    if _is_ip(value):  # a bare IPv6 address (an --allow-host argument; a Host header brackets it)
        return str(ipaddress.ip_address(value))
    try:
        parts = urlsplit("//" + value)
        name, _ = parts.hostname, parts.port  # .port raises ValueError for a port that is not a number
    except ValueError:
        return None
    if not name or parts.path or parts.query or parts.fragment or parts.username is not None:
        return None
    name = name.rstrip(".")
    return str(ipaddress.ip_address(name)) if _is_ip(name) else name


def origin_of(value: str) -> str | None:
    """A web origin as browsers send it (`scheme://host[:port]`, lowercase, no path), or None."""
    value = value.strip().rstrip("/")
    if value in ("*", "null"):
        return value
    try:
        parts = urlsplit(value)
        _ = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query \
            or parts.fragment or parts.username is not None:
        return None
    return f"{parts.scheme}://{parts.netloc.lower()}"


class HostPolicy:
    """Which Host headers name this server: the loopback names (any port), the bound address, the
    --allow-host names; with a wildcard bind (0.0.0.0, ::) any IP address as well, since a browser
    sends an IP address as Host only when its page was loaded from that address (DNS rebinding needs
    a name). `*` among the extra names turns the check off; so does bound None (an app that is not
    bound by page-local's command, which does not know its names)."""

    def __init__(self, bound: str | None, extra: list[str] | tuple[str, ...] = ()):
        self.check = bound is not None and "*" not in extra
        names = set(LOOPBACK_NAMES)
        self.any_ip = bound is not None and bound.strip("[]") in WILDCARD_BINDS
        if bound is not None and not self.any_ip:
            names.add(host_name(bound) or bound.lower())
        for e in extra:
            if e != "*":
                n = host_name(e)
                if n is None:
                    raise ValueError(f"{e!r} is not a host name or address (give a name like my-pc.lan, "
                                     "without scheme, path or port)")
                names.add(n)
        self.names = frozenset(names)

    def allows(self, host: str | None) -> bool:
        if not self.check:
            return True
        name = host_name(host) if host else None
        if name is None:
            return False
        return name in self.names or (self.any_ip and _is_ip(name))


class OriginPolicy:
    """Which web pages may call the server: the --cors-origin origins (`*`: any), and the server's own
    origin: `http://HOST` where HOST is the request's own Host header and the HostPolicy checks it (a
    web UI served by this server from GET /). Without a Host check no origin is its own: a rebound
    name would pass for it."""

    def __init__(self, cors_origins: list[str] | tuple[str, ...], hosts: HostPolicy):
        self.cors = frozenset(cors_origins)
        self.any = "*" in self.cors
        self.hosts = hosts

    def allows(self, origin: str, host: str | None) -> bool:
        if self.any or origin in self.cors:
            return True
        if not self.hosts.check or not host or not self.hosts.allows(host):
            return False
        return _same_origin(origin, host)


def _same_origin(origin: str, host: str) -> bool:
    try:
        o = urlsplit(origin)
        h = urlsplit("//" + host)
        o_port, h_port = o.port or 80, h.port or 80
    except ValueError:
        return False
    return (o.scheme == "http" and not o.path and o.hostname is not None
            and host_name(host) == host_name(o.netloc) and o_port == h_port)


async def _refuse(e: ApiError, scope, receive, send) -> None:
    from starlette.responses import JSONResponse

    body = {"error": e.message} if scope["path"].startswith("/api/") else e.body()  # Ollama's routes: its shape
    await JSONResponse(body, status_code=e.status, headers=e.headers)(scope, receive, send)


class HostGuard:
    """403 for a Host header that does not name this server (HostPolicy)."""

    def __init__(self, app, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.policy.check:
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        host = Headers(scope=scope).get("host")
        if self.policy.allows(host):
            return await self.app(scope, receive, send)
        if not host:
            why = "the request has no Host header; send one that names this server (127.0.0.1, localhost)"
        else:
            shown = host_name(host) or host
            why = (f"the Host header {host!r} is not a name of this server (it answers to localhost, "
                   f"127.0.0.1, [::1], its --host address and the --allow-host names); if {shown!r} is one of "
                   f"its names, start the server with --allow-host {shown}")
        await _refuse(ApiError(403, why, "host_not_allowed"), scope, receive, send)


class OriginGuard:
    """403 for a request whose Origin header is not allowed (OriginPolicy), preflights included."""

    def __init__(self, app, policy: OriginPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or self.policy.allows(origin, headers.get("host")):
            return await self.app(scope, receive, send)
        why = (f"requests from web pages at {origin!r} are not allowed; to let that site call this server, "
               f"start it with --cors-origin {origin}")
        await _refuse(ApiError(403, why, "origin_not_allowed"), scope, receive, send)


class KeyGuard:
    """Every route but /health needs `Authorization: Bearer KEY` with one of `keys` (each compared in
    constant time, all of them every time). The request's namespace, scope["state"]["namespace"], is
    `key-` and a hash of the key, or NO_KEY on a server without keys. A hash, not the key's place in `keys`: the
    disk cache's folders are named after it (engine/prefixes.py), so after a restart with the keys in another
    order, or another key in a removed one's place, a key would read (and time) another key's documents."""

    def __init__(self, app, keys: list[str] | tuple[str, ...] = ()):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.names = ["key-" + hashlib.sha256(k).hexdigest()[:16] for k in self.keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.keys:
            scope.setdefault("state", {})["namespace"] = NO_KEY
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in OPEN_PATHS or (scope["method"] in ("GET", "HEAD")
                                  and (path in PAGE_PATHS or path.startswith(PAGE_PREFIX))):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        token = token.strip()
        found = None
        for i, key in enumerate(self.keys):  # no early exit: the time does not tell which key matched
            if hmac.compare_digest(token, key) and found is None:
                found = i
        if scheme.lower() != b"bearer" or found is None:
            why = "no API key was sent" if not given else "the API key is wrong"
            e = ApiError(401, f"{why}: send the server's key as `Authorization: Bearer KEY`", "invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
            return await _refuse(e, scope, receive, send)
        scope.setdefault("state", {})["namespace"] = self.names[found]
        return await self.app(scope, receive, send)


class JsonOnly:
    """415 for a POST whose Content-Type is not application/json. A body without a Content-Type is read
    as JSON: browsers send Origin with every POST, so such a request from a web page is the
    OriginGuard's; the declared types a page may send without a preflight (text/plain, forms) are what
    this refuses."""

    METHODS = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in self.METHODS:
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        declared = Headers(scope=scope).get("content-type")
        if declared is None or declared.split(";", 1)[0].strip().lower() == "application/json":
            return await self.app(scope, receive, send)
        e = ApiError(415, f"the request body must be JSON sent as `Content-Type: application/json`, "
                          f"not {declared!r}", "unsupported_media_type")
        await _refuse(e, scope, receive, send)
