"""Domain errors. The servicers map each kind to one gRPC status code."""

from __future__ import annotations


class KvxferError(Exception):
    """Base class: a request the daemon refuses, with a message for the caller."""


class InvalidArgument(KvxferError):
    """A field is malformed or outside what the caller registered."""


class NotFound(KvxferError):
    """Unknown engine, room or slot."""


class FailedPrecondition(KvxferError):
    """The request is well-formed but not allowed in the current state."""


class AlreadyExists(KvxferError):
    """A duplicate (chunk enqueued twice, room expected twice)."""


class ResourceExhausted(KvxferError):
    """No space in a ring or the pool right now."""


class Unavailable(KvxferError):
    """The daemon is draining or a peer cannot be reached."""


class PermissionDenied(KvxferError):
    """The caller may not touch this object (another engine's room or slot)."""
