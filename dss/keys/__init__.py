"""Keys and identity: the master key, the server secret (tenants, receipt subjects), per-tenant
data keys, and the engine cache salts."""
