"""Keys and identity: the master key, the server secret (tenants, receipt subjects), per-tenant
data keys, the engine cache salts. Master-key rotation and the one-time upgrade of the tenant
derivation are in `dss.ops.key_changes`."""
