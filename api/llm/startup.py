"""Starting the embedded vLLM engine against the store's RPC: the model resolved (and prepared),
caching checked before any engine process starts (refused, or served uncached when allowed), the
model fingerprint the connector writes pages under registered, the engine's processes put behind
the API's on the CPU (`api.llm.engine_priority`).

vLLM and `engine_patch.setup` are imported only here, and only when the engine starts.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from api.http_errors import UncachedModel
from api.llm.chat_engine import ChatEngine
from api.llm.engine_priority import child_pids, lower_engine_priority
from api.llm.sampling import tool_parser_class
from api.settings import Settings
from dss.store import Store
from dss.types import FingerprintId
from dss.wire import tag_key

log = logging.getLogger("dss.api.llm")

KV_CACHING_OFF = "KV caching is turned off (DSS_ENGINE__KV_CACHING=false)"


async def start_chat_engine(settings: Settings, store: Store) -> ChatEngine:
    """Start the engine against the store's RPC (blocking parts run in a worker thread)."""
    from engine_patch.setup import factory
    from engine_patch.setup.model import resolve_model

    eng = settings.engine
    data_dir = settings.store.resolved_data_dir
    model_path = await asyncio.to_thread(resolve_model, eng.model, data_dir)
    address, authkey = store.serve_rpc()
    known = set(store.fingerprints)
    es = eng.engine_settings(model_path)
    if eng.tool_call_parser is not None:
        tool_parser_class(eng.tool_call_parser)  # an unknown name fails before the model loads
    uncached: list[str] = []

    def check_caching(vllm_config: Any) -> None:
        # Before any engine process starts: refuse, rather than serve uncached unannounced.
        from engine_patch.connector.fingerprint import uncached_reason

        if not eng.kv_caching:
            log.warning("serving model %s WITHOUT KV caching: %s", Path(model_path).name, KV_CACHING_OFF)
            uncached.append(KV_CACHING_OFF)
            return
        reason = uncached_reason(vllm_config)
        if reason is None:
            return
        if not eng.allow_uncached:
            raise UncachedModel(
                f"DSS cannot cache model {Path(model_path).name}: {reason} "
                "(set DSS_ENGINE__ALLOW_UNCACHED=true to serve it without caching)"
            )
        log.warning("serving model %s WITHOUT KV caching: %s", Path(model_path).name, reason)
        uncached.append(reason)

    before = child_pids()
    llm = await asyncio.to_thread(factory.build_async_engine, address, authkey, es, check_caching)
    try:
        tokenizer = llm.get_tokenizer()
        model_config = llm.model_config
        max_len = int(model_config.max_model_len)
        name = eng.served_model_name or Path(model_path).name
        fid = None if uncached else _engine_fingerprint(factory, llm, store, known)
        if fid is not None:
            await asyncio.to_thread(store.prepare_pages, fid)  # not in the first turn's engine step
    except BaseException:
        llm.shutdown()
        raise
    lower_engine_priority(before, eng.cpu_priority, eng.nice)
    log.info("engine ready: model %s, context %d tokens, fingerprint %s", name, max_len, fid)
    engine = ChatEngine(
        llm,
        tokenizer,
        model_name=name,
        max_model_len=max_len,
        fingerprint=fid,
        max_inflight=eng.max_inflight,
        retry_after_s=eng.retry_after_s,
        slots_per_user=eng.slots_per_user,
        tag_key=tag_key(authkey),
        default_sampling=_generation_defaults(model_config),
        tool_call_parser=eng.tool_call_parser,
        planner=store.kv if fid is not None else None,
    )
    engine.model_names |= {Path(model_path).name, str(model_path)}
    engine.uncached_reason = uncached[0] if uncached else None
    return engine


def _generation_defaults(model_config: Any) -> dict[str, Any]:
    try:
        return dict(model_config.get_diff_sampling_param())
    except Exception:  # a model without a generation config
        return {}


def _engine_fingerprint(
    factory: Any, llm: Any, store: Store, known_before: set[FingerprintId]
) -> FingerprintId | None:
    """The model fingerprint the engine's connector writes pages under, registered in the store.

    The connector registers the same id from the engine process and reports it with every
    session request's result (`TurnReport.fingerprint`), which `generate` checks.
    """
    try:
        from engine_patch.connector.fingerprint import (
            GroupsKnownInEngine,
            frontend_fingerprint,
            registered_for_model,
        )

        try:
            return store.fingerprints.register(frontend_fingerprint(llm.vllm_config))
        except GroupsKnownInEngine:
            # A sliding-window model: the engine's connector registered its fingerprint.
            known = [store.fingerprints.get(f) for f in store.fingerprints]
            found = registered_for_model(llm.vllm_config, known)
            if len(found) == 1:
                return found[0].id
    except Exception as exc:  # a config the connector cannot describe: it is off as well
        log.warning("cannot compute the engine's model fingerprint here (%s); guessing from the store", exc)
    fresh = [f for f in store.fingerprints if f not in known_before]
    return fresh[0] if len(fresh) == 1 else None
