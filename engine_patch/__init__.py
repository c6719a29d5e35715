"""DSS inside vLLM: the KV connector, the engine factory and the default model (see README.md).

Imports `dss` and vLLM, never `api`. Importing this package imports neither vLLM nor torch.
"""
