"""The tier manager, one job a module, composed by `TieredPages`:

- `manager`: `TieredPages`, what the store calls (queries, leases, pins, classes, the moves below,
  `check`);
- `writer`: `PageWriter`, a claimed host page written to disk (write-through, write-back) and to the
  remote tier (write-behind);
- `promotion`: `Promoter`, disk or remote → host;
- `demotion`: `Demoter`, host → disk on request (never loses a page);
- `host_room`, `disk_room`: `HostRoom`, `DiskRoom`, eviction when a tier is full;
- `copies`: `PageCopies`, deleting the copies of pages out of the table, giving up claims;
- `counters`: `TierCounters`.
"""

from dss.pages.placement.counters import TierCounters
from dss.pages.placement.manager import TieredPages
from dss.pages.placement.writer import DataKeyLookup

__all__ = ["DataKeyLookup", "TierCounters", "TieredPages"]
