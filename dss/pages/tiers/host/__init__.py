"""The host tier: pages in fixed-size slots of shared-memory files that other processes map.

A `HostArena` is one file of `n_slots` slots of `slot_nbytes` bytes in a shared-memory directory,
mapped with `mmap`. The owner (`HostTier`) decides which slot holds which page; another process
(the engine's worker, the page-codec helpers) attaches the same file by its path and copies slot
bytes to and from KV blocks directly, so page bytes never travel through a socket.

One job per module: `shm` (the private shared-memory directories and their checks), `arena` (the
arena file format and its mapping; what `engine_patch.connector` imports), `tier` (`HostTier`, the
owner's slot allocator).
"""

from dss.pages.tiers.host.arena import HostArena, arena_layout
from dss.pages.tiers.host.shm import CAPACITY_SETTING, SHM_DIR, default_base, remove_private_dir
from dss.pages.tiers.host.tier import HostTier

__all__ = [
    "CAPACITY_SETTING",
    "SHM_DIR",
    "HostArena",
    "HostTier",
    "arena_layout",
    "default_base",
    "remove_private_dir",
]
