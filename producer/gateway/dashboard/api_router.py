"""``/dashboard``: the live web dashboard (issue 27), behind the gateway's API keys.

How the browser passes the key. A browser's ``EventSource`` (the live feed) cannot send an
``Authorization`` header, and a page opened from the address bar sends none either; a key in the URL would
land in the browser's history, proxies' and servers' access logs and ``Referer`` headers. So the page asks
for the key once (a form that is all ``/dashboard`` answers, with 401, without one), ``POST
/dashboard/login`` checks it and sets it as a cookie that is ``HttpOnly`` (no script reads it),
``SameSite=Strict`` (no other site's page sends it) and ``Path=/dashboard`` (never sent to ``/v1``: the
``/v1`` routes read only the ``Authorization`` header, so the cookie cannot be used to submit or cancel
work, and a cross-site form cannot ride on it), ``Secure`` when the page came over HTTPS. Every
``/dashboard`` route also takes ``Authorization: Bearer <key>`` as ``/v1`` does (scripts, curl, the tests).
The page, ``/dashboard/api/state`` and ``/dashboard/api/events`` answer 401 without a valid key; only the
static files (the page's script, style and charting library: no data) and the login form are open.
An open gateway (no keys configured) serves the dashboard to anyone, as it serves ``/v1``.
"""
from __future__ import annotations

import asyncio
import json
from importlib import resources
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from pagestream.producer.gateway.auth import KeyTable
from pagestream.producer.gateway.dashboard import data
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import Event
from pagestream.producer.protocol.tenants import OPEN, Tenant

router = APIRouter()

COOKIE = "pagestream_dashboard"
#: the feed's state refresh (queues, workers, bulks, dead letters) and its XREAD block
STATE_EVERY_S = 2.0
FEED_BLOCK_S = 1.0
#: a feed ends after this long and the browser reconnects (``retry``), so a feed never outlives its key's check by long
FEED_MAX_S = 600.0
#: open feeds per gateway (each holds a Redis connection while it blocks)
MAX_FEEDS = 32
#: a login form field longer than this is not a key
MAX_LOGIN_BYTES = 4096

_STATIC = {"app.js": "text/javascript", "app.css": "text/css", "vendor/uPlot.iife.min.js": "text/javascript",
           "vendor/uPlot.min.css": "text/css", "vendor/uPlot.LICENSE": "text/plain"}
_HEADERS = {
    # the page loads only its own files; uPlot sizes its canvas through element.style (CSSOM, not inline markup)
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}


def _asset(name: str) -> str:
    return resources.files("pagestream.producer.gateway.dashboard").joinpath("static", *name.split("/")).read_text()


def _tenant(request: Request) -> Tenant | None:
    """The tenant of the request's key (bearer header, else the dashboard cookie); None: no valid key."""
    table: KeyTable = request.app.state.gateway.keys
    if table.open:
        return OPEN
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return table.tenant(token)
    cookie = request.cookies.get(COOKIE)
    return table.tenant(cookie) if cookie else None


def _login_page(status: int, message: str = "") -> HTMLResponse:
    html = _asset("login.html").replace("{{message}}", message)
    headers = {**_HEADERS, "WWW-Authenticate": 'Bearer realm="pagestream"'} if status == 401 else _HEADERS
    return HTMLResponse(html, status_code=status, headers=headers)


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "invalid or missing API key (send 'Authorization: Bearer <key>' or log in "
                                              "at /dashboard)", "type": "invalid_request_error", "code": "invalid_api_key"}},
                        status_code=401, headers={"WWW-Authenticate": 'Bearer realm="pagestream"'})


@router.get("/dashboard", include_in_schema=False)
async def page(request: Request) -> Response:
    if _tenant(request) is None:
        return _login_page(401)
    return HTMLResponse(_asset("index.html"), headers=_HEADERS)


@router.post("/dashboard/login", include_in_schema=False)
async def login(request: Request) -> Response:
    body = await request.body()
    if len(body) > MAX_LOGIN_BYTES:
        return _login_page(401, "That is not a key.")
    key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
    table: KeyTable = request.app.state.gateway.keys
    if not table.open and (not key or table.tenant(key) is None):
        return _login_page(401, "That key is not valid.")
    resp = RedirectResponse("/dashboard", status_code=303)
    if not table.open:
        resp.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/dashboard",
                        secure=request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https")
    return resp


@router.post("/dashboard/logout", include_in_schema=False)
async def logout() -> Response:
    resp = RedirectResponse("/dashboard", status_code=303)
    resp.delete_cookie(COOKIE, path="/dashboard")
    return resp


@router.get("/dashboard/static/{name:path}", include_in_schema=False)
async def static(name: str) -> Response:
    kind = _STATIC.get(name)
    if kind is None:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response(_asset(name), media_type=kind, headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


def _owners(request: Request) -> data.Owners:
    state = request.app.state.gateway
    owners = getattr(state, "dashboard_owners", None)
    if owners is None:
        owners = state.dashboard_owners = data.Owners(state.producer.redis)
    return owners


@router.get("/dashboard/api/state", include_in_schema=False)
async def api_state(request: Request) -> Response:
    tenant = _tenant(request)
    if tenant is None:
        return _unauthorized()
    state = request.app.state.gateway
    return JSONResponse(await data.snapshot(state.producer, tenant, _owners(request)), headers={"Cache-Control": "no-store"})


def _sse(event: str, payload: object, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@router.get("/dashboard/api/events", include_in_schema=False)
async def api_events(request: Request) -> Response:
    """Server-sent events: ``hello`` (the whole snapshot, with the charts' history), then ``ev`` for each event
    of the firehose as this tenant may see it, and ``state`` (queues, workers, bulks, dead letters) every
    ``STATE_EVERY_S``. A reconnect starts again with ``hello``."""
    tenant = _tenant(request)
    if tenant is None:
        return _unauthorized()
    state = request.app.state.gateway
    feeds = getattr(state, "dashboard_feeds", 0)
    if feeds >= MAX_FEEDS:
        return JSONResponse({"error": {"message": "too many dashboard feeds open on this gateway", "type": "server_error"}},
                            status_code=503, headers={"Retry-After": "5"})
    producer, owners = state.producer, _owners(request)
    state.dashboard_feeds = feeds + 1

    async def feed():
        loop = asyncio.get_running_loop()
        try:
            snap = await data.snapshot(producer, tenant, owners)
            last = snap["last_event_id"]
            yield b"retry: 1000\n" + _sse("hello", snap, last)
            next_state, end = loop.time() + STATE_EVERY_S, loop.time() + FEED_MAX_S
            stream = keys.events_stream()
            while loop.time() < end and not await request.is_disconnected():
                reply = await producer.redis.xread({stream: last}, count=500, block=int(FEED_BLOCK_S * 1000))
                events = [Event.parse(i, f) for _, entries in reply or [] for i, f in entries]
                if events:
                    last = events[-1].id
                    for view in await data.visible(tenant, owners, events):
                        yield _sse("ev", view, view.get("id"))
                if loop.time() >= next_state:
                    next_state = loop.time() + STATE_EVERY_S
                    yield _sse("state", await data.snapshot(producer, tenant, owners, with_history=False))
                else:
                    yield b": keep-alive\n\n"
        finally:
            state.dashboard_feeds -= 1

    return StreamingResponse(feed(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
