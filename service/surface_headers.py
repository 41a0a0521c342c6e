"""Security headers: no framing and no content sniffing anywhere, a Content-Security-Policy on /ui.

The web UI shows job names, events and specs a tenant wrote; it escapes them, and the CSP is the
second line should one escape be missed: scripts only from the API's own /ui/static files (no
inline script, no eval), nothing fetched from anywhere but the API, no plugins, and the pages
may not be framed (clickjacking). Styles allow 'unsafe-inline' because the page sets widths and
colours in style attributes (progress bars, chart swatches): a style cannot run code. Only /ui
gets the CSP: /docs (Swagger UI) loads its scripts from a CDN.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

UI_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_EVERYWHERE = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY")]
_UI = [(b"content-security-policy", UI_CSP.encode()), (b"referrer-policy", b"no-referrer")]


def is_ui(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


class SecurityHeaders:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = _EVERYWHERE + (_UI if is_ui(scope.get("path", "")) else [])

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in extra if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, with_headers)
