"""The rendezvous' error answers: an `HttpError` becomes an ErrorResponse with its status, never a crash."""
from __future__ import annotations

from typing import Any


class HttpError(Exception):
    """A rejected request: rendered as an ErrorResponse and counted under rejected_requests_total{reason}."""

    def __init__(self, status: int, reason: str, message: str, details: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.details, self.headers = status, reason, message, details, headers


def unauthenticated(message: str) -> HttpError:
    return HttpError(401, "unauthenticated", message, headers={"WWW-Authenticate": 'Bearer realm="disagg-rendezvous"'})


def forbidden(message: str) -> HttpError:
    return HttpError(403, "forbidden", message)
