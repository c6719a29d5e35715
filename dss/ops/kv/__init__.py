"""KV loads and saves for engines: the prefix index and the tiered pages used together.

- `cache`: `KVCache` (match, loads, saves, leases, erasure cooperation, pins);
- `matching`: `MatchInfo`, what a match is;
- `records`: a load's lease and a pending save;
- `remote`: adopting pages of the fleet's remote tier into a local match.
"""

from dss.ops.kv.cache import KVCache
from dss.ops.kv.matching import MatchInfo

__all__ = ["KVCache", "MatchInfo"]
