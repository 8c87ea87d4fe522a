"""What a client call raises when the service, not its arguments, is the trouble."""

from __future__ import annotations


class ServiceError(Exception):
    """The control plane could not serve a request (or the client can no longer talk to it)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestTimeout(ServiceError):
    """The request did not finish in time; the client has asked the control plane to abort it.

    Also raised, with nothing sent, when the call's timeout ran out while an earlier request with
    the same id was still being aborted (see `Client`).
    """


class RequestFailed(ServiceError):
    """The control plane refused the request (`ErrorReply`) or it finished with an error."""
