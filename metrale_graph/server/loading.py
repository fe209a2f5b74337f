"""The app a server answers with while its model loads, so that it listens from the start.

    gate = Loading()                       # uvicorn.Config(gate, lifespan="off", ...): it answers at once
    gate.serve(build_app(engine, ...))     # the model has loaded: every request goes to the app from now on

While loading, /health (and /ping) answers 503 `{"status": "loading"}`, /version the package's version, and every
other request 503 with Retry-After in OpenAI's error shape (code "loading"), its body left unread; the app then
answers /health 503 "warming up" until its engine is warm (app.state.server.ready), 200 after.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from .app import package_version
from .errors import loading


class Loading:
    """ASGI app: 503 for every HTTP request until serve(app), then `app`'s answers. Other scopes (websocket)
    get no answer while loading; lifespan events are not taken (run uvicorn with lifespan="off": the app of
    build_app has no startup or shutdown handlers)."""

    def __init__(self):
        self.app = None

    def serve(self, app) -> None:
        """Hand every request from now on to `app` (from any thread)."""
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/")  # (with a trailing slash too, as the app serves it)
        if path in ("/health", "/ping"):
            response = JSONResponse({"status": "loading"}, status_code=503)
        elif path == "/version":
            response = JSONResponse({"version": package_version()})
        else:
            response = loading().response()
        await response(scope, receive, send)
