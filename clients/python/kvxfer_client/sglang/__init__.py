"""sglang transfer backend ``kvxferd``: ``--disaggregation-transfer-backend kvxferd``.

Installed with the package (entry point group ``sglang.srt.plugins``, name ``kvxferd``), sglang
calls :func:`register` in each of its processes: it adds ``kvxferd`` to the backend choices, adds
the member to sglang's ``TransferBackend`` enum and hooks ``get_kv_class`` so that the
disaggregation code gets this package's manager, sender, receiver and bootstrap server.
Tested against sglang 0.5.23 (the ``[sglang]`` extra pins it). The daemon socket comes from
``KVXFERD_SOCKET`` (else the default path); ring size from ``KVXFER_SGLANG_RING_BYTES``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "kvxferd"
_UTILS = "sglang.srt.disaggregation.utils"

__all__ = ["BACKEND", "register"]


def classes() -> dict[str, type]:
    """The backend's classes by sglang's KVClassType value."""
    from kvxfer_client.sglang._bootstrap import KvxferdKVBootstrapServer
    from kvxfer_client.sglang._conn import KvxferdKVManager, KvxferdKVSender
    from kvxfer_client.sglang._receiver import KvxferdKVReceiver

    return {"manager": KvxferdKVManager, "sender": KvxferdKVSender, "receiver": KvxferdKVReceiver,
            "bootstrap_server": KvxferdKVBootstrapServer}


def extended_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """sglang's TransferBackend with a KVXFERD member (an Enum cannot gain members in place)."""
    members = {m.name: m.value for m in original}
    if BACKEND in members.values():
        return original
    members["KVXFERD"] = BACKEND
    return enum.Enum(original.__name__, members, module=original.__module__)  # type: ignore[return-value]


def get_kv_class_hook(original_fn: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook on get_kv_class: our classes for the kvxferd backend, sglang's otherwise."""
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND and class_type.value != "kvargs":
        return classes()[class_type.value]
    return original_fn(transfer_backend, class_type)


def register() -> None:
    """sglang general-plugin entry point."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(f"{_UTILS}.TransferBackend", _transfer_backend_replacement(), HookType.REPLACE)
    HookRegistry.register(f"{_UTILS}.get_kv_class", get_kv_class_hook, HookType.AROUND)
    logger.info("kvxferd transfer backend registered")


def _transfer_backend_replacement() -> Any:
    # The REPLACE hook is resolved when sglang applies hooks (the module is imported then), so the
    # replacement is built from the original at that moment.
    import importlib

    return extended_transfer_backend(importlib.import_module(_UTILS).TransferBackend)
