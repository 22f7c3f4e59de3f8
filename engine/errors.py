"""The errors every layer raises and ``serve/`` maps to HTTP status codes by type (never by message text).

    RayInferError
    ├── InvalidRequestError (also a ValueError)  400: this request is malformed or out of range
    ├── UnsupportedError    (also a ValueError)  400/501: valid, but this deployment cannot do it
    ├── OverloadedError                          503: no capacity now; retry later
    └── EngineInternalError                      500: a bug or a dead replica; the detail is logged
        └── ReplicasDeadError                    500: every replica of a role is gone for good

``InvalidRequestError`` and ``UnsupportedError`` subclass ``ValueError`` so that code which validates
with ``except ValueError`` (config checks, the batch job) keeps working. ``param`` names the offending
field when there is one (OpenAI's ``error.param``).
"""

from __future__ import annotations


class RayInferError(Exception):
    """Base of rayinfer's errors.

    Args:
        message: what went wrong, naming the problem.
        param: the request field at fault, or None.
    """

    status: int = 500

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # survive Ray's pickling with ``param``
        return (type(self), (self.message, self.param))


class InvalidRequestError(RayInferError, ValueError):
    """A request the engine or API cannot take as given (bad field, empty or too-long prompt); 400."""

    status = 400


class UnsupportedError(RayInferError, ValueError):
    """A valid request or config this deployment does not support (e.g. a topology without a feature)."""

    status = 400


class OverloadedError(RayInferError):
    """No replica can take the request now (queues or memory full); retry later; 503."""

    status = 503


class EngineInternalError(RayInferError):
    """An engine step, actor or transfer failed for reasons that are not the request's; 500."""

    status = 500


class ReplicasDeadError(EngineInternalError):
    """Every replica of one role (a colocated fleet's replicas, or all prefill or all decode replicas of a
    PD fleet) is dead and will not come back: out of ``max_restarts`` (or killed for good, as Ray Direct
    Transport does to both ends of a failed transfer) and out of ``max_replacements``. Requests fail at
    once instead of retrying until ``pd.retry_deadline_s``; 500."""
