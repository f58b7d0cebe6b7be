"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every answer that is not a success goes through `APIError`, so a client (the `openai`
package, lm-eval's retries) reads one shape whatever went wrong: a bad field (400, naming
it), a bad key (401), an unknown model or route (404), an overloaded server (503 with
`Retry-After`), or a fault inside the engine (500, with its message).
"""

from starlette.responses import JSONResponse


class APIError(Exception):
    """An answer in OpenAI's error shape.

    **Arguments:**

    - `status`: the HTTP status.
    - `message`: what is wrong and, where there is one, the fix.
    - `param`: the request field at fault, or `None`.
    - `type`: OpenAI's error type (`"invalid_request_error"`, `"server_error"`, ...).
    - `code`: a short machine-readable code, or `None`.
    - `headers`: extra headers (`Retry-After`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 (OpenAI's field name)
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_field(param: str, message: str) -> APIError:
    """A 400 for the request field `param`."""
    return APIError(400, message, param=param)


def overloaded(limit: int) -> APIError:
    """A 503 with `Retry-After`: the server holds as many samples as it takes."""
    return APIError(
        503,
        f"The server is overloaded: it holds {limit} samples, running or waiting, and takes no "
        "more until some finish. Retry after a moment.",
        type="server_error",
        code="server_overloaded",
        headers={"Retry-After": "1"},
    )
