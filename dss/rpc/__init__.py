"""A small local RPC between the store's owner process and vLLM's engine processes.

- `transport`: the socket's address and authkey, kernel I/O bounds, the errors callers see;
- `contract`: what an engine may call (`EngineStore`, the one contract) and the owner's table of
  the parts that answer each call (`EngineCalls`);
- `server`: `StoreServer`, one thread per connected engine process;
- `client`: `StoreClient`, with a deadline on every call.

Every cross-process call has a deadline; a miss is a cache miss for the engine, never a hang.
"""

from dss.rpc.client import StoreClient
from dss.rpc.contract import ENGINE_CALLS, EngineCalls, EngineStore
from dss.rpc.server import StoreServer
from dss.rpc.transport import StoreTimeout, StoreUnavailable, socket_path_for
from dss.wire import LoadPlan, PageSlot, SavePlan

__all__ = [
    "ENGINE_CALLS",
    "EngineCalls",
    "EngineStore",
    "LoadPlan",
    "PageSlot",
    "SavePlan",
    "StoreClient",
    "StoreServer",
    "StoreTimeout",
    "StoreUnavailable",
    "socket_path_for",
]
