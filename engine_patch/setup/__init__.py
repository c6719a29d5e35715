"""Engine set-up: the engine factory (`factory`), vLLM engine arguments (`engine_args`), the
default model's pull and verification (`model`, `sanity`). Imports `engine_patch.connector` (to name
it in vLLM's KV transfer config), never the reverse.
"""
