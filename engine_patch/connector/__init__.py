"""The KV connector: what runs inside vLLM's processes (engine core and workers).

`dss_connector.DSSConnector` is what vLLM loads (`kv_connector_module_path`); it wires vLLM's hooks
to `scheduler_side` (engine core) and `worker_side` (each worker). Imports `dss` and vLLM, never
`engine_patch.setup` or `api`.
"""
