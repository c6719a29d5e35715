"""The REST API of DSS: an OpenAI-compatible, session-aware chat server (`dss serve`).

Import rules: `api` builds on `dss` (the store) and `engine_patch` (the vLLM engine factory);
nothing in `dss` or `engine_patch` imports `api`. vLLM itself is imported only by `api.llm`, and
only when the engine starts or a turn arrives, so the non-engine parts (settings, auth, errors,
routes over a store without an engine) work and test without it. Importing any module here has no side
effects: the app, the store and the engine are made by `api.app.create_app` and its lifespan.
"""
