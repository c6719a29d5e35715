"""Keys and identity: the master key, the server secret (tenants, receipt subjects), per-tenant
data keys, the engine cache salts, master-key rotation, and the one-time upgrade of the tenant
derivation."""
