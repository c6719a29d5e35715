"""KV loads and saves for engines: the prefix index and the tiered pages used together, and what
is built on them (the public prefixes, the addresses of a user's saved pages).

- `cache`: `KVCache`, the one surface callers use; it puts the parts below together;
- `lookup`: `KVLookup` (match, residency, a tenant's stored KV as `StoredKV`, `forget`);
- `loads`: `KVLoads` (loads, their leases, the loader threads, remote adoption);
- `saves`: `KVSaves` (pending and published saves, the erasure's side of them);
- `tenant_gate`: `TenantGate` (which tenants may save now, their saves in flight);
- `pins`: `PublicPins` (public prefixes kept pinned);
- `matching`: `MatchInfo`, what a match is;
- `in_flight`: a load's lease and a pending save;
- `remote_adoption`: adopting pages of the fleet's remote tier into a local match;
- `writeback`: `DiskWriter`, the write-through thread `KVCache` starts;
- `public_prefixes`: `PublicPrefixes`, the admin-registered prefixes (the `public_prefixes` table);
- `addresses`: the addresses a user's pages of some token ids can have been saved under.
"""

from dss.ops.kv.cache import KVCache
from dss.ops.kv.lookup import StoredKV
from dss.ops.kv.matching import MatchInfo

__all__ = ["KVCache", "MatchInfo", "StoredKV"]
