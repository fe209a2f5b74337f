"""Every error the server answers, built here, in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

400 for bad parameters and malformed JSON (FastAPI's validation errors, the engine's ValueError, a
prompt longer than the context), 401 for a missing or wrong API key, 404 for an unknown model or
path, 413 for a body over the server's limit, 503 with Retry-After while the waiting queue is full
(EngineFullError), the model loads, the server warms up or shuts down (EngineClosedError), 500 for
anything else (logged; the server goes on). A stream
that has started reports its error as one event (`stream_event`) before `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..handle import EngineClosedError, EngineFullError
from .responses import ErrorBody, ErrorInfo

logger = logging.getLogger("metrale_graph.server")

RETRY_AFTER_S = 1  # what a 503 asks a client to wait before it tries again
INVALID = "invalid_request_error"
REQUEST_PARTS = ("body", "query", "path", "header", "cookie")  # where FastAPI's validation errors say a value came from

# what a field of a union type takes, for the message of a value that fits none of its members
EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0) or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...}; an assistant's may also be "
               "{'type': 'refusal', 'refusal': ...})",
}


class APIError(Exception):
    """An error answered to the client: HTTP `status` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return ErrorBody(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                         code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def unknown_model(name: str, served: str | tuple[str, ...]) -> APIError:
    """404 for a model name the server does not serve (`served`: its name, or names)."""
    names = " or ".join(map(repr, (served,) if isinstance(served, str) else served))
    return APIError(404, f"the model {name!r} does not exist: this server serves {names}", param="model",
                    code="model_not_found")


def loading() -> APIError:
    return APIError(503, "the server is loading its model: try again shortly", type="server_error", code="loading",
                    retry_after=RETRY_AFTER_S)


def body_too_large(limit: int, size: int | None = None) -> APIError:
    """413 for a request body over `limit` bytes (`size`: its Content-Length; None: a body sent in chunks, cut
    off once it passed the limit)."""
    got = f"{size} bytes" if size is not None else "more, sent in chunks"
    return APIError(413, f"the request body is larger than this server takes: at most {limit} bytes "
                         f"(--max-request-bytes), got {got}", code="request_too_large")


def warming_up() -> APIError:
    return APIError(503, "the server is warming up (compiling its bucket grid): try again shortly",
                    type="server_error", code="warming_up", retry_after=RETRY_AFTER_S)


def from_engine(e: BaseException, param: str | None = None) -> APIError:
    """The APIError of an exception raised by the engine for a request: its ValueError names what is wrong
    with the request (400); refusals are 503; anything else failed the request's step (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return bad_request(str(e), param=param)
    if isinstance(e, EngineFullError):
        return APIError(503, str(e), type="server_error", code="engine_overloaded", retry_after=RETRY_AFTER_S)
    if isinstance(e, EngineClosedError):
        return APIError(503, f"the server is shutting down ({e})", type="server_error", code="shutting_down",
                        retry_after=RETRY_AFTER_S)
    return internal_error(e)


def from_failure(e: BaseException) -> APIError:
    """The APIError of a request that failed after the engine took it: the engine shut down (503), or its
    step failed (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineClosedError):
        return from_engine(e)
    return internal_error(e)


def internal_error(e: BaseException, log: bool = True) -> APIError:
    """500 for an exception nothing expected (logged with its traceback unless `log` is False; the server
    goes on)."""
    if log:
        logger.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
    return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error",
                    code="internal_error")


def stream_event(e: BaseException) -> str:
    """The server-sent event of an error after a stream started (the status line has gone already)."""
    return f"data: {json.dumps(from_failure(e).body())}\n\n"


def validation_error(e: RequestValidationError, content_type: str | None = None) -> APIError:
    """400 naming the first bad field (OpenAI's `param`) and what it takes. `content_type`: the request's
    header (a body sent as a form, curl's default, is not read as JSON)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", first.get("msg"))
        return bad_request(f"the request body is not valid JSON: {why}", code="invalid_json")
    body = getattr(e, "body", None)
    loc = error_path(first, body)
    if not loc and first.get("type") == "missing":  # no body at all (JSON's null is another error: not an object)
        return bad_request("the request body is empty: send a JSON object, with the header 'Content-Type: "
                           "application/json'", code="invalid_json")
    if not loc:
        if not content_type or "json" not in content_type.lower():
            got = f"Content-Type: {content_type}" if content_type else "no Content-Type"
            return bad_request(f"the request body must be JSON, sent with the header 'Content-Type: "
                               f"application/json' (got {got})", code="invalid_json")
        return bad_request(f"the request body must be a JSON object: {first.get('msg')}")
    field = loc[0]
    same = [err for err in errors if error_path(err, body)[:1] == [field]]
    leaf = next((p for p in reversed(loc) if p in EXPECTED), None)
    if len(same) > 1 and leaf is not None:  # a value that fits none of a union's members, named by its path
        where = ".".join(loc[:len(loc) - loc[::-1].index(leaf)])  # ("messages.2.content": which message's)
        return bad_request(f"{where}: expected {EXPECTED[leaf]}, got {short(first.get('input'))}", param=field)
    path = ".".join(loc)
    message = pydantic_message(first)
    # (a validator's own message that quotes the value it is about, as an input item's does: not the field's whole value)
    quoted = first.get("type") == "value_error" and "(got " in message
    got = f" (got {short(first['input'])})" if "input" in first and first.get("type") != "missing" and not quoted else ""
    return bad_request(f"{path}: {message}{got}", param=field)


def error_path(error: dict, body=None) -> list[str]:
    """The fields of one of pydantic's errors: its `loc` without the part of the request FastAPI puts first ("body",
    "query", "path", ...: OpenAI's `param` is the field or query parameter itself, `limit` not `query`) and without the
    tag pydantic puts where a union tagged by `type` chose its member. With `body` (what was validated), the tag is
    found as a loc element that is no key of the object it stands in (but a missing field's, its error's last) and is
    that object's `type` (the Responses API's flat tools: {"type": "function", "name": ...}'s `tools.0.function.name` is
    `tools.0.name`) or repeats the element before it (chat's {"type": "function", "function": {...}}:
    `tools.0.function.function.name` is `tools.0.function.name`, and where the key's value is no object, a null
    function, `tools.0.function.function` is `tools.0.function`: the tag, the object's type followed by the key of its
    name); without it, as an element that repeats the one before it (no field of these bodies holds a field of its own
    name)."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] in REQUEST_PARTS:
        loc = loc[1:]
    path: list[str] = []
    node, known, tag = body, body is not None, False  # the value at `path` in the body, while the body has it
    missing = error.get("type") == "missing"  # (its last element is a key the body lacks: named, never a tag)
    for i, part in enumerate(loc):
        if known and isinstance(node, dict) and not tag and not (missing and i == len(loc) - 1) and (
                part not in node or (node.get("type") == part and loc[i + 1:i + 2] == [part])):  # (chat's tag then key)
            if node.get("type") == part or (path and path[-1] == str(part)):
                tag = True  # (one tag an object)
                continue
        elif not known and path and path[-1] == str(part):
            continue
        path.append(str(part))
        tag = False
        if known and isinstance(node, dict) and part in node:
            node = node[part]
        elif known and isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            known = False
    return path


def pydantic_message(error: dict) -> str:
    """The message of one of pydantic's errors; a check's own ValueError's words, without pydantic's "Value error, "."""
    message = str(error.get("msg"))
    return message.removeprefix("Value error, ") if error.get("type") == "value_error" else message


def http_error(e: HTTPException, method: str, path: str):
    """The response of Starlette's and FastAPI's own HTTPExceptions: no route (404), a method the route does
    not take (405, with the Allow header RFC 9110 asks for), a body that could not be read (400: not UTF-8)."""
    allow = ", ".join(sorted(m.strip() for m in (e.headers or {}).get("Allow", "").split(",") if m.strip()))
    if e.status_code == 404:
        error = APIError(404, f"no route {method} {path}", code="not_found")
    elif e.status_code == 405:
        error = APIError(405, f"{path} does not take {method}" + (f" (it takes {allow})" if allow else ""),
                         code="method_not_allowed")
    elif e.status_code == 400:  # FastAPI's "There was an error parsing the body": JSON's own errors are 422s
        error = APIError(400, f"the request body could not be parsed: it must be a JSON object encoded as UTF-8, "
                              f"nested at most a few hundred levels deep ({e.detail})", code="invalid_json")
    else:
        error = APIError(e.status_code, str(e.detail))
    response = error.response()
    if allow:
        response.headers["Allow"] = allow
    return response


def short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def install(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape, and never let one end the server."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return validation_error(e, request.headers.get("content-type")).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return http_error(e, request.method, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # not logged here: Starlette raises the exception on after this response, and uvicorn logs its traceback
        return internal_error(e, log=False).response()
