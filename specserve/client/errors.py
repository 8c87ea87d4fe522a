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


class ServiceUnreachable(ServiceError):
    """Nothing could be sent: no connection to the control plane came up within the client's
    timeout (it is not running), or, at once, the control plane refused the handshake (it
    requires keys this client does not have, or does not accept the ones it has)."""


class RequestFailed(ServiceError):
    """The control plane refused the request (`ErrorReply`) or it finished with an error.

    `code`: "invalid" (the request as sent cannot be served), "overloaded" (retry later) or
    "failed" (it was accepted, then failed).
    """

    def __init__(self, message: str, request_id: str | None = None, code: str = "failed") -> None:
        super().__init__(message, request_id)
        self.code = code


UNREACHABLE_HINT = (
    "is it running, and does it require keys (--keys) that this client was not given?"
)


def unreachable_message(url: str, waited_s: float | None, refusal: str | None = None) -> str:
    if refusal is not None:
        return f"the control plane at {url} refused the connection: {refusal}"
    waited = "" if not waited_s else f" within {waited_s:g} s"
    return f"no connection to the control plane at {url}{waited}: {UNREACHABLE_HINT}"
