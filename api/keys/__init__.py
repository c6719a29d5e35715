"""Key administration beside `api.auth`'s keys: the registered frontends whose keys act for
their end users (`frontends`), and the audit trail of who changed keys and frontends (`audit`)."""
