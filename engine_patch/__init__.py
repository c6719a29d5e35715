"""DSS inside vLLM: the KV connector (`connector/`, runs in vLLM's processes) and the engine set-up
(`setup/`: factory, engine arguments, the default model); see README.md.

Imports `dss` and vLLM, never `api`. Importing this package imports neither vLLM nor torch.
"""
