"""Cross-host KV transfer over the Mooncake Transfer Engine (TCP or RDMA). Registered, not implemented yet.

Importing this module without the library raises an ImportError that names the extra to install.
"""

from __future__ import annotations

try:
    import mooncake.engine  # noqa: F401
except ImportError as e:  # also the CUDA build on a host without libcudart / libcuda
    raise ImportError(
        "the 'mooncake' KV transfer backend needs the Mooncake Transfer Engine: pip install voxserve[mooncake] "
        "(mooncake-transfer-engine on GPU hosts, mooncake-transfer-engine-non-cuda on CPU hosts; "
        f"import failed with: {e})"
    ) from e

from voxserve.kv_transfer.base import KVConnector


class MooncakeConnector(KVConnector):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("the mooncake KV transfer backend is registered but not implemented yet")
