"""Tests of `dss.pages`: codecs, page files, the page table, eviction and the tiers."""
