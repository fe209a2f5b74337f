"""The FastAPI app of an Engine: OpenAI's completions, chat and responses endpoints (stored responses read back, deleted
and their input items listed, a request's input tokens counted), vLLM's /tokenize and /detokenize, /health (and
vLLM's /ping), /version, /v1/models, /metrics.

    app = build_app(engine, model_name="qwen3.5-9b", api_key=None)    # serve it with uvicorn
    app.state.server.ready.clear() / .set()                           # /health: 503 until set
    app = Loading(); ...; app.serve(build_app(engine, ...))           # loading.py: 503s before the model loads

Endpoints are thin: completions.py and chat.py run the requests (through generation.py, which only
submits to the engine and awaits its outputs: the engine loop alone steps the model), protocol.py
and responses.py hold the wire format, errors.py every error answer; tokenization.py runs vLLM's tokenizer
endpoints. Every path is served with a trailing slash too (NoTrailingSlash). With an API key, every /v1 path and the
tokenizer endpoints need `Authorization: Bearer <key>` (checked before the body is read); /health, /ping, /version
and /metrics are open. Every answer carries an `X-Request-Id` (the request's own, else a new one). A body of
more than `max_request_bytes` is answered 413 while it is read (limits.BodyLimit). `with_cors(app, ...)` wraps an
app (metrale-serve: the Loading gate, so answers while the model loads have the headers too) in CORSMiddleware,
vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials.
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from . import errors
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError, unknown_model
from .generation import ClientGone
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ModelList
from .responses_api import count_input_tokens, create_response
from .responses_api_protocol import ResponsesRequest
from .responses_store import DEFAULT_SIZE as DEFAULT_STORE_SIZE
from .responses_store import list_items
from .state import ServerState
from .tokenization import DetokenizeRequest, create_detokenize, create_tokenize, tokenizer_info


class EventStream(StreamingResponse):
    """Server-sent events; the body's generator is closed however the response ends (a client gone:
    Starlette cancels it; an error sending), so a request it runs is aborted then, not when collected."""
    media_type = "text/event-stream"

    def __init__(self, events):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def package_version() -> str:
    """metrale-graph's version, as installed (GET /version; "unknown" where it is run from a tree not installed)."""
    try:
        return importlib.metadata.version("metrale-graph")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# the paths an API key guards: the OpenAI API's and vLLM's tokenizer endpoints (/health and /metrics stay open)
KEYED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


class APIKeyMiddleware:
    """401 for a request of a KEYED path without the server's key, before anything reads its body."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.state.api_key is not None and scope["path"].startswith(KEYED):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            try:
                self.state.check_api_key(authorization)
            except APIError as e:
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class NoTrailingSlash:
    """Every path is served with a trailing slash too (`POST /v1/completions/`, as curl users and some clients' base
    URLs write it): the slashes are dropped before routing. Starlette answered such a path 307 to the path without,
    which curl without -L never follows (an empty answer) and a client following it may resend without the body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and len(scope["path"]) > 1 and scope["path"].endswith("/"):
            path = scope["path"].rstrip("/") or "/"
            scope = {**scope, "path": path, "raw_path": scope.get("raw_path", b"").rstrip(b"/") or b"/"}
        await self.app(scope, receive, send)


class RequestIdHeader:
    """Every answer carries `X-Request-Id`: the request's own (a client's tracing id, echoed as vLLM's
    --enable-request-id-headers does), else a new one, as OpenAI's answers carry one (the openai client reads it as a
    response's `_request_id`, an error's `request_id`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, sending)


def with_cors(app, allowed_origins=("*",), allowed_methods=("*",), allowed_headers=("*",),
              allow_credentials: bool = False) -> CORSMiddleware:
    """`app` behind CORS, as vLLM's server: a preflight (OPTIONS with Origin and Access-Control-Request-Method)
    answered here, before the API key's check (browsers send no credentials on it), and every answer to an
    allowed origin with its Access-Control-Allow-* headers (401s and 413s included, so that a page can read them).
    Origins, methods and headers: lists, "*" for any."""
    return CORSMiddleware(app, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                          allow_headers=list(allowed_headers), allow_credentials=allow_credentials)


def build_app(engine, model_name: str | Sequence[str], api_key: str | None = None, ready: bool = True,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_call_parser: str = "auto",
              reasoning_parser: str = "auto", enable_tokenizer_info: bool = False,
              responses_store_size: int = DEFAULT_STORE_SIZE) -> FastAPI:
    """The app serving `engine` as `model_name` (or several names, vLLM's --served-model-name a b: a request may name
    any of them, /v1/models lists them all, answers report the first); its ServerState is `app.state.server`. ready=False:
    /health and the generation endpoints answer 503 until `app.state.server.ready.set()`. A request body of
    more than `max_request_bytes` is a 413. tool_call_parser ("qwen3_xml", "qwen3_json", "none") and
    reasoning_parser ("qwen3", "none") read chat replies; "auto": as the tokenizer's chat template shows them
    (reply.py). enable_tokenizer_info: GET /tokenizer_info answers (vLLM's --enable-tokenizer-info-endpoint: it
    shows the chat template and the tokenizer's configuration). responses_store_size: the Responses API's stored
    responses (the last N, LRU; 0: none, so no previous_response_id; responses_store.py)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive number of bytes, got {max_request_bytes}")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"model_name must be a non-empty name or a non-empty list of them, got {model_name!r}")
    state = ServerState(engine, names, api_key, ready, tool_call_parser, reasoning_parser, responses_store_size)
    app = FastAPI(title="metrale-graph", summary=f"OpenAI-compatible server of {names[0]}")
    app.state.server = state
    app.add_middleware(NoTrailingSlash)  # (innermost: the path routed is the path without its trailing slash)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(APIKeyMiddleware, state=state)  # (added late, it runs early: a 401 reads no body)
    app.add_middleware(RequestIdHeader)  # (first of all: every answer carries the id, a 401's and a 413's too)
    errors.install(app)

    def respond(out):
        if isinstance(out, BaseModel):
            return Response(out.model_dump_json(), media_type="application/json")
        return EventStream(out)

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) health check: /health's answer
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status = ("shutting down" if state.closing.is_set() else "ok" if state.ready.is_set() else "warming up")
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/version")  # vLLM's: the server's package version
    async def version():
        return JSONResponse({"version": package_version()})

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return respond(ModelList(data=[state.model_card(name) for name in state.model_names]))

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in state.model_names:
            raise unknown_model(model, state.model_names)
        return respond(state.model_card(model))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return respond(await create_completion(state, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return respond(await create_chat_completion(state, body, request))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return respond(await create_response(state, body, request))

    @app.post("/v1/responses/input_tokens")  # (OpenAI's: the input tokens of a response's request, not run)
    async def response_input_tokens(body: ResponsesRequest):
        return respond(await count_input_tokens(state, body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:  # (OpenAI's resumption of a background response's stream: nothing runs in the background here)
            raise errors.bad_request("stream: this server runs no background responses, so there is no stream to "
                                     "resume: leave it unset", param="stream")
        return respond(state.responses.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")  # (OpenAI's, for background responses: none run here)
    async def cancel_response(response_id: str):
        state.responses.get(response_id)  # an unknown id: the 404 naming it
        raise errors.bad_request(f"response {response_id!r} has completed: only a background response (background: "
                                 "true) can be cancelled, and this server runs none")

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, after: str | None = None, limit: int = 20,
                                   order: str = "desc"):
        return respond(list_items(state.responses.get(response_id), after, limit, order))

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)):
        return respond(await create_tokenize(state, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return respond(await create_detokenize(state, body))

    if enable_tokenizer_info:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return JSONResponse(tokenizer_info(state))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone):  # nobody reads it: the request was aborted
        return Response(status_code=499)

    for route in app.routes:  # HEAD is GET without the body (RFC 9110; uvicorn sends none), as Starlette's routes take it
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")
    return app
