"""One exception tree for the bundle, each error knowing its HTTP status and OpenAI error shape."""

from __future__ import annotations

from typing import Any


class BundleError(Exception):
    """Base of every error the bundle raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict[str, Any]:
        """The body OpenAI's API returns for errors; the `openai` SDK parses exactly this."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(BundleError):
    status_code = 400
    error_type = "invalid_request_error"


class RequestTooLarge(InvalidRequest):
    status_code = 413
    code = "request_too_large"


class Unauthorized(BundleError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(BundleError):
    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(BundleError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class IdempotencyConflict(BundleError):
    """Same X-Request-Id with a different body: refusing is the only safe answer."""

    status_code = 422
    error_type = "invalid_request_error"
    code = "request_id_conflict"


class EventsGone(BundleError):
    """Resume asked for events the server no longer holds: say so rather than leave a gap."""

    status_code = 410
    error_type = "invalid_request_error"
    code = "events_gone"


class ProducerLost(EventsGone):
    """The replica running this id's generation stopped (its heartbeat lapsed): the rest of the
    stream will never come. Retrying the same id cannot help; start again with a new id."""

    code = "producer_lost"


class Overloaded(BundleError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(BundleError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"


class StoreUnavailable(BundleError):
    """The shared identity store (Redis) cannot be reached: a request with an X-Request-Id is
    refused rather than run without the one-generation-per-id promise."""

    status_code = 503
    error_type = "server_error"
    code = "identity_store_unavailable"


class StoredError(BundleError):
    """An error another replica answered for this request id, carried as it was sent."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        error = body.get("error") or {}
        super().__init__(str(error.get("message", "request failed")), param=error.get("param"))
        self.status_code = status_code
        self.error_type = str(error.get("type", "server_error"))
        self.code = error.get("code")


class WeightsUnavailable(BundleError):
    """Weights named by URL (Cog's COG_WEIGHTS) could not be fetched or unpacked: a setup
    failure whose message names the URL and what went wrong, never a half-loaded model."""

    status_code = 500
    error_type = "server_error"
    code = "weights_unavailable"


class CompileCacheRefused(BundleError):
    """A compile-cache pack that cannot be used for this start: unreadable, damaged, unsafe, or
    made for another one. Never fatal: the start logs it in one line and goes on without it."""

    status_code = 500
    error_type = "server_error"
    code = "compile_cache_refused"


class GenerationFailed(BundleError):
    status_code = 500
    error_type = "server_error"
    code = "generation_failed"


class Cancelled(BundleError):
    status_code = 499
    error_type = "cancelled"
    code = "request_cancelled"


class UnsupportedMediaType(InvalidRequest):
    """A POST body that is not declared JSON. Browsers send `text/plain` cross-origin without a
    preflight, so accepting it would let any web page start generations on a keyless server."""

    status_code = 415
    code = "unsupported_media_type"


class HeadersTooLarge(InvalidRequest):
    status_code = 431
    code = "request_header_fields_too_large"


class RequestTimeout(InvalidRequest):
    status_code = 408
    code = "request_timeout"


class ShuttingDown(BundleError):
    """The server is stopping (SIGTERM): not a failure of the request or of the engine. A client
    with an X-Request-Id retries with the same id, elsewhere or after the restart."""

    status_code = 503
    error_type = "server_error"
    code = "server_shutting_down"


# Refused at admission: nothing ran, so the id is free and a retry under it is safe.
SHUTDOWN_MESSAGE = (
    "the server is shutting down and did not start this request; retry with the same X-Request-Id"
)
# A generation under an id ends once: a request under that id replays its outcome, a failure too,
# for as long as it is held (BUNDLE_RETENTION_S; with a shared store, on every replica). So a
# generation that failed part-way is run again under a new id, never resumed.
RUN_AGAIN_ADVICE = (
    "send the request again, under a new X-Request-Id if it had one (that id replays this failure)"
)
SHUT_DOWN_MID_GENERATION = f"the server shut down before this generation finished; {RUN_AGAIN_ADVICE}"


def abort_error(reason: str) -> BundleError:
    """The error a generation aborted for `reason` ends with (the registry names the reasons)."""
    if reason == "shutdown":
        return ShuttingDown(SHUT_DOWN_MID_GENERATION)
    return Cancelled(f"generation aborted: {reason}")


class SetupError(BundleError):
    """The server cannot start as configured (a binary it needs is missing, a setting asks for
    something this machine cannot give): `python -m shared.serve` prints the message on one line
    and exits with 2, before any engine starts."""

    code = "setup_error"
