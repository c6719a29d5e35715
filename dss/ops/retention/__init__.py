"""Session retention: which KV pages stay in the host tier, and which go first.

Each session carries a hint (`kv_retention`: `pinned`, `normal` or `evict`) and an optional idle
TTL (`kv_idle_ttl_s`), stored on its row (`VersionStore.set_retention`). This package turns them
into page retention classes (`dss.pages.eviction.RetentionClass`) and tier moves, one job a module:

- `classes`: the classification rules (which pages a session reaches, the class each gets, the
  pinned caps);
- `registry`: `RetentionRegistry`, what is remembered of sessions and their pages' classes;
- `worker`: `RetentionWorker`, the one thread every reclassification and demotion runs on;
- `sweep`: `IdleSweeper`, reclassifying updated sessions and demoting idle ones;
- `warmup`: `Warmer`, promoting a version's disk pages into the host tier;
- `service`: `SessionRetention`, what the store and the API call, composing the above.
"""

from dss.ops.retention.service import KEEP, Keep, SessionRetention
from dss.ops.retention.warmup import WarmPlan

__all__ = ["KEEP", "Keep", "SessionRetention", "WarmPlan"]
