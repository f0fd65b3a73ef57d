"""Cross-host KV transfer over NIXL (UCX). Registered, not implemented yet.

Importing this module without the library raises an ImportError that names the extra to install.
"""

from __future__ import annotations

try:
    import nixl  # noqa: F401
except ImportError as e:
    raise ImportError(
        "the 'nixl' KV transfer backend needs NIXL: pip install legato[nixl] "
        "(on CPU-only hosts: pip install --no-deps nixl nixl-cu12; a plain `pip install nixl` pulls ~3 GB; "
        f"import failed with: {e})"
    ) from e

from legato.kv_transfer.base import KVConnector


class NixlConnector(KVConnector):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("the nixl KV transfer backend is registered but not implemented yet")
