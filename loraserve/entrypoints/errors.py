"""HTTP errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

# OpenAI's client maps status codes to these exception names; we use the same.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "TimeoutError",
    413: "BadRequestError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        # None: the name OpenAI's client gives the status. vLLM names some errors
        # more finely (InvalidUserInput), and clients match on those names.
        self._error_type = error_type

    @property
    def error_type(self) -> str:
        if self._error_type is not None:
            return self._error_type
        return _ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase.replace(" ", ""))

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)


def invalid_user_input(message: str, param: str | None = None) -> APIError:
    """vLLM's 400 for a malformed adapter load/unload request."""
    return APIError(HTTPStatus.BAD_REQUEST, message, param, error_type="InvalidUserInput")


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, message, param)


def engine_unavailable(message: str = "The engine is not running.") -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message)
