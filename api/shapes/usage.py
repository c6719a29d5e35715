"""A turn's token accounting as the wire shows it: OpenAI's `usage` and DSS's `dss` split of
where the prompt's KV came from."""

from __future__ import annotations

from collections.abc import Mapping

from api.shapes.schemas import DssInfo, LeadUpdateInfo, PromptTokensDetails, TierTokens, Usage
from api.turn.lead import LeadReport
from api.turn.pipeline import Done


def usage(done: Done) -> Usage:
    """OpenAI's counting: the prompt once, every choice's output tokens."""
    split = done.split
    n_out = sum(len(a.fin.output_ids) for a in done.answers)
    return Usage(
        prompt_tokens=split.prompt_tokens,
        completion_tokens=n_out,
        total_tokens=split.prompt_tokens + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=split.cached),
    )


def dss_info(done: Done) -> DssInfo:
    """The split as the connector reported it (`api.turn.pipeline.PromptSplit`)."""
    split, plan = done.split, done.prep.plan
    return DssInfo(
        cached_tokens=split.cached,
        engine_cached_tokens=split.engine_cached,
        loaded_tokens=split.loaded,
        loaded_from=_tiers(split.loaded_from),
        resident=_tiers(split.found_in),
        lead_update=_lead(plan.lead),
        truncated_messages=plan.truncated,
        echoed_answers=done.turn.target.echoed if done.turn.target is not None else 0,
    )


def _lead(lead: LeadReport | None) -> LeadUpdateInfo | None:
    if lead is None:
        return None
    return LeadUpdateInfo(
        served=lead.served,
        reason=lead.reason,
        kind=lead.kind,
        changed=lead.changed,
        placement=lead.placement,
        update=lead.update,
        update_tokens=lead.update_tokens,
        reused_tokens=lead.reused_tokens,
    )


def _tiers(counts: Mapping[str, int]) -> TierTokens:
    return TierTokens(**{k: v for k, v in counts.items() if k in TierTokens.model_fields})
