"""A turn's token accounting as the wire shows it: OpenAI's `usage` and DSS's `dss` split of
where the prompt's KV came from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from api.llm.generation import Finished
from api.shapes.schemas import DssInfo, LeadUpdateInfo, PromptTokensDetails, TierTokens, Usage
from api.turn.lead import LeadReport
from api.turn.types import Prepared


def usage(prep: Prepared, fins: Sequence[Finished]) -> Usage:
    """OpenAI's counting: the prompt once, every choice's output tokens."""
    n_prompt = len(prep.prompt_ids)
    n_out = sum(len(f.output_ids) for f in fins)
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=_cached(prep, fins)),
    )


def _cached(prep: Prepared, fins: Sequence[Finished]) -> int:
    # The prompt is computed once for all choices: the choice that found the most tells.
    return min(max((f.num_cached_tokens for f in fins), default=0), len(prep.prompt_ids))


def dss_info(prep: Prepared, fins: Sequence[Finished]) -> DssInfo:
    """The split as the connector reported it (the prompt was matched once, by the connector;
    with several choices, by the one that loaded the most)."""
    cached = _cached(prep, fins)
    reports = [f.report for f in fins if f.report is not None]
    report = max(reports, key=lambda r: r.loaded_tokens, default=None)
    loaded = report.loaded_tokens if report is not None else 0
    return DssInfo(
        cached_tokens=cached,
        engine_cached_tokens=max(0, cached - loaded),
        loaded_tokens=loaded,
        loaded_from=_tiers(report.loaded_from if report else {}),
        resident=_tiers(report.found_in if report else {}),
        lead_update=_lead(prep.lead),
        truncated_messages=prep.truncated,
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
