"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the right status.

| status | type | when |
|---|---|---|
| 400 | invalid_request_error | bad JSON or UTF-8, wrong types, bad parameters, prompt over the context |
| 401 | authentication_error | missing, unknown or revoked API key |
| 403 | permission_error | the key may not use the tier asked for |
| 404 | not_found_error | unknown model or route |
| 413 | invalid_request_error | request body over the size limit |
| 429 | rate_limit_error | queue full or the key's tokens-per-minute used up (with Retry-After) |
| 500 | server_error | a bug |
| 503 | server_error | shutting down / model failed to load |
"""

from __future__ import annotations

import math


class APIError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class ContextOverflow(APIError):
    status, type = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class AuthError(APIError):
    status, type = 401, "authentication_error"

    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(message, code=code)


class TierNotEntitled(APIError):
    status, type = 403, "permission_error"

    def __init__(self, message: str):
        super().__init__(message, param="service_tier", code="tier_not_entitled")


class ModelNotFound(APIError):
    status, type = 404, "not_found_error"

    def __init__(self, model: str, available: list[str]):
        super().__init__(f"The model {model!r} does not exist on this server; available: {', '.join(available)}",
                         param="model", code="model_not_found")


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"request body is larger than the limit of {limit} bytes", code="request_too_large")


class RateLimited(APIError):
    status, type = 429, "rate_limit_error"

    def __init__(self, message: str, retry_after: float, code: str = "rate_limit_exceeded"):
        super().__init__(message, code=code, retry_after=retry_after)


class QueueFull(RateLimited):
    def __init__(self, model: str, retry_after: float = 1.0):
        super().__init__(f"the server's queue for {model!r} is full; retry shortly", retry_after, code="queue_full")


class Unavailable(APIError):
    status, type = 503, "server_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


def type_for_status(status: int) -> str:
    return _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
