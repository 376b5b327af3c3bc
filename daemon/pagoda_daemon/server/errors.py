"""OpenAI-style errors: every failure a client sees has the same JSON shape."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a response is made: `pagoda operator` reads this module without fastapi
    from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error with an HTTP status and the fields of OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param, code)


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(message, HTTPStatus.SERVICE_UNAVAILABLE, code="service_unavailable",
                    headers={"Retry-After": str(retry_after_s)})
