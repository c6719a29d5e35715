"""A small local RPC between the store's owner process and vLLM's engine processes.

- `transport`: the socket's address and authkey, kernel I/O bounds, the errors callers see;
- `service`: what is served (`StoreService`) and the adapter over the owner's parts (`EngineCalls`);
- `server`: `StoreServer`, one thread per connected engine process;
- `client`: `StoreClient`, with a deadline on every call.

Every cross-process call has a deadline; a miss is a cache miss for the engine, never a hang.
"""

from dss.rpc.client import StoreClient
from dss.rpc.server import StoreServer
from dss.rpc.service import EngineCalls, KVService, StoreService
from dss.rpc.transport import StoreTimeout, StoreUnavailable, socket_path_for
from dss.wire import LoadPlan, PageSlot, SavePlan

__all__ = [
    "EngineCalls",
    "KVService",
    "LoadPlan",
    "PageSlot",
    "SavePlan",
    "StoreClient",
    "StoreServer",
    "StoreService",
    "StoreTimeout",
    "StoreUnavailable",
    "socket_path_for",
]
