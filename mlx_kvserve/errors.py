"""One exception tree for the whole project; the server maps it to HTTP status in one place."""

from __future__ import annotations


class KVServeError(Exception):
    """Base of every error this project raises on purpose."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(KVServeError):
    """A configuration file or flag is invalid; the message names the key."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelLoadError(KVServeError):
    """A model could not be found, fetched or converted."""


class InvalidRequestError(KVServeError):
    """The request is understood but cannot be served as asked (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ValidationError(InvalidRequestError):
    """A request field has the wrong type, a missing or an unknown value (422)."""

    status_code = 422


class NotFoundError(InvalidRequestError):
    status_code = 404


def model_not_found(name: str, served: list[str]) -> NotFoundError:
    """The 404 for a request naming a model this server does not serve (`served`: the ids it does)."""
    names = ", ".join(repr(n) for n in served)
    return NotFoundError(f"model {name!r} not found; this server serves {names}", param="model", code="model_not_found")


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413


class OverloadedError(KVServeError):
    """The request queue is full; the client should retry later (429)."""

    status_code = 429
    error_type = "rate_limit_error"


class ConflictError(InvalidRequestError):
    """The request conflicts with the server's state: e.g. a pin asked of a server that shares its
    cache folder as a guest, whose pins belong to the folder's owner (409)."""

    status_code = 409


class ShuttingDownError(KVServeError):
    status_code = 503
    error_type = "server_error"


class AuthenticationError(KVServeError):
    """The request lacks the API key its path needs, or presents a wrong one (401)."""

    status_code = 401
    error_type = "invalid_request_error"  # what OpenAI answers for a bad key, with code "invalid_api_key"


class PermissionDeniedError(KVServeError):
    """The request's key is right but may not do this: e.g. a cache admin action that reaches every
    key's cache, asked with an inference key while several keys cache apart (403)."""

    status_code = 403
    error_type = "permission_error"


class RequestTimeoutError(KVServeError):
    """The request ran past server.first_token_timeout_s or server.request_timeout_s (504); the
    generation was cancelled."""

    status_code = 504
    error_type = "server_error"


class BodyTimeoutError(InvalidRequestError):
    """The request body did not arrive within server.body_read_timeout_s (408)."""

    status_code = 408


class InsufficientStorageError(KVServeError):
    """A change could not be persisted (a full or read-only disk); it was not applied (507)."""

    status_code = 507
    error_type = "server_error"
