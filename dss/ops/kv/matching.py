"""What a match is: `MatchInfo` (whole pages, then the page a match ends inside), cut from an
index match to the pages still in the page table."""

from __future__ import annotations

from dataclasses import dataclass

from dss.index.prefix_index import IndexMatch
from dss.types import PageHash


@dataclass(frozen=True, slots=True)
class MatchInfo:
    n_tokens: int
    pages: tuple[PageHash, ...]  # whole pages, then the page the match ends inside, if any
    public_tokens: int
    partial_tokens: int = 0  # tokens used of the last page when the match ends inside it (0: none)

    def page_tokens(self, block_size: int) -> list[int]:
        """Tokens used of each page of the match."""
        sizes = [block_size] * len(self.pages)
        if self.partial_tokens and sizes:
            sizes[-1] = self.partial_tokens
        return sizes


def with_partial(m: IndexMatch) -> tuple[PageHash, ...]:
    return (*m.pages, m.partial) if m.partial is not None else m.pages


def match_info(m: IndexMatch, n_ok: int, block_size: int) -> MatchInfo:
    """The match cut to its first `n_ok` pages (those still in the page table)."""
    n_full = min(n_ok, len(m.pages))
    used = m.partial_tokens if m.partial is not None and n_ok > len(m.pages) else 0
    pages = (*m.pages[:n_full], m.partial) if used and m.partial is not None else m.pages[:n_full]
    public = min(m.public_pages, n_full) * block_size
    return MatchInfo(n_full * block_size + used, tuple(pages), public, used)
