"""Domain errors. Each kind carries the gRPC status code it maps to (as a number, so the domain
modules never import grpc): the servicers answer with it, the peer stream sends it in replies."""

from __future__ import annotations


class KvxferError(Exception):
    """Base class: a request the daemon refuses, with a message for the caller."""

    code = 2


class InvalidArgument(KvxferError):
    """A field is malformed or outside what the caller registered."""

    code = 3


class NotFound(KvxferError):
    """Unknown engine, room or slot."""

    code = 5


class FailedPrecondition(KvxferError):
    """The request is well-formed but not allowed in the current state."""

    code = 9


class AlreadyExists(KvxferError):
    """A duplicate (chunk enqueued twice, room expected twice)."""

    code = 6


class ResourceExhausted(KvxferError):
    """No space in a ring or the pool right now."""

    code = 8


class CapExceeded(ResourceExhausted):
    """A caller reached one of the daemon's caps (kvxferd.core.caps); the message names it and its
    config key."""


class Unavailable(KvxferError):
    """The daemon is draining or a peer cannot be reached."""

    code = 14


class PermissionDenied(KvxferError):
    """The caller may not touch this object (another engine's room or slot)."""

    code = 7
