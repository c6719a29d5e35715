"""Who may call the API: the API keys (`api_keys`), the registered frontends whose keys act for
their end users (`frontends`), the audit trail of who changed keys and frontends (`audit`), and
the API's tables as the store reaches them (`store_tables`)."""
