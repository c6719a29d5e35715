"""Erasure holds while traffic runs: a save of the user that was in flight during the erase, or
that arrives after it under the user's old tenant (a generation still running), stores nothing;
the re-created user is a new tenant that starts cold; verification checks everything of the old
tenant, whenever it was written."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import func, select

from dss.db.models import DataKey, PageRow
from dss.errors import KeyDestroyed
from dss.pages.meta import PageMeta
from dss.types import NamespaceId, PageHash
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence


def _rows(store, tenant) -> tuple[int, int]:
    with store.sf() as s:
        pages = s.scalar(select(func.count()).select_from(PageRow).where(PageRow.tenant == tenant))
        keys = s.scalar(select(func.count()).select_from(DataKey).where(DataKey.tenant == tenant))
    return int(pages or 0), int(keys or 0)


def test_saves_in_flight_or_after_an_erase_store_nothing(tmp_path):
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    old = store.identity.tenant_for("alice")
    first = np.arange(1, 17, dtype=np.int32)
    put_sequence(store, fid, old, first, pages_for(SMALL_FP, first))
    # A generation's save planned before the erase and committed after it:
    late = np.arange(100, 116, dtype=np.int32)
    plan = store.kv.plan_save(fid, old, late, 4)
    for ps in plan.pages:
        store.host.slot_array(ps.slot)[:] = np.frombuffer(pages_for(SMALL_FP, late)[ps.page_index], np.uint8)
    receipt = store.eraser.erase_user("alice")
    assert store.kv.saves.commit_save(plan.save_id, [ps.page_index for ps in plan.pages]) == 0
    # ... and a save that arrives afterwards under the old tenant (the request was tagged before):
    again = np.arange(200, 216, dtype=np.int32)
    assert put_sequence(store, fid, old, again, pages_for(SMALL_FP, again)) == 0
    with pytest.raises(KeyDestroyed):
        store.keyring.data_key(old)
    store.flush()
    assert store.kv.match(fid, old, again).n_tokens == 0 and store.kv.match(fid, old, late).n_tokens == 0
    assert _rows(store, old) == (0, 0)
    assert not any(h.tenant == old for h, _, _ in store.disk.scan())
    assert store.eraser.verify(receipt.id).remnants == 0
    # The re-created user is a new tenant: cold in the store, and in vLLM's own cache (the salt).
    new = store.identity.tenant_for("alice")
    assert new != old and store.identity.cache_salt("alice") == new
    assert load_sequence(store, fid, new, first) == (0, [])
    assert put_sequence(store, fid, new, first, pages_for(SMALL_FP, first)) == 4
    assert load_sequence(store, fid, new, first)[0] == 16
    store.check()
    store.close()
    # Durable: after a restart the old tenant is still refused and the new one still in use.
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    assert store.identity.tenant_for("alice") == new
    assert put_sequence(store, fid, old, again, pages_for(SMALL_FP, again)) == 0
    assert load_sequence(store, fid, new, first)[0] == 16
    store.close()


def test_verification_counts_rows_written_after_the_erase(tmp_path):
    """It only counted rows created before `erased_at`, so a page written back afterwards passed."""
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    old = store.identity.tenant_for("bob")
    tokens = np.arange(1, 9, dtype=np.int32)
    put_sequence(store, fid, old, tokens, pages_for(SMALL_FP, tokens))
    receipt = store.eraser.erase_user("bob")
    assert store.eraser.verify(receipt.id).remnants == 0
    planted = PageMeta(
        hash=PageHash(b"\x01" * 32),
        namespace=NamespaceId(b"\x02" * 16),
        tenant=old,
        fingerprint=fid,
        parent=PageHash(b"\x00" * 32),
        index=0,
        nbytes=SMALL_FP.page_nbytes,
        tokens=tokens[:4],
        checksum=b"\x03" * 16,
    )
    store.pages.rows.add(planted, 100, b"\x00" * 32)  # as a write-back racing the erase would have
    v = store.eraser.verify(receipt.id)
    assert v.remnants == 1 and "page row" in " ".join(v.details)
    store.close()


def test_a_save_planned_before_an_erase_keeps_its_slots_until_the_engine_reports_it(tmp_path):
    # The engine may still be copying the erased user's KV into a planned save's slots. Freed at
    # the erase, the next reservation (LIFO) hands the same slot to another user's save, and the
    # late copy lands in that user's page.
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    a_tokens = np.arange(100, 116, dtype=np.int32)
    a_plan = store.kv.plan_save(fid, alice, a_tokens, 4)
    a_bytes = pages_for(SMALL_FP, a_tokens)
    for ps in a_plan.pages:
        store.host.slot_array(ps.slot)[:] = np.frombuffer(a_bytes[ps.page_index], np.uint8)
    store.eraser.erase_user("alice")
    for ps in a_plan.pages:  # zeroed at once, though still reserved
        assert not store.host.slot_array(ps.slot).any()
    b_tokens = np.arange(500, 516, dtype=np.int32)
    b_plan = store.kv.plan_save(fid, bob, b_tokens, 4)
    assert {ps.slot.slot for ps in b_plan.pages}.isdisjoint({ps.slot.slot for ps in a_plan.pages})
    b_bytes = pages_for(SMALL_FP, b_tokens)
    for ps in b_plan.pages:
        store.host.slot_array(ps.slot)[:] = np.frombuffer(b_bytes[ps.page_index], np.uint8)
    for ps in a_plan.pages:  # the engine's late copy of alice's save
        store.host.slot_array(ps.slot)[:] = np.frombuffer(a_bytes[ps.page_index], np.uint8)
    assert store.kv.saves.commit_save(b_plan.save_id, [ps.page_index for ps in b_plan.pages]) == 4
    assert store.kv.saves.commit_save(a_plan.save_id, [ps.page_index for ps in a_plan.pages]) == 0
    for ps in a_plan.pages:  # freed (and zeroed) once the engine reported the save
        assert not store.host.slot_array(ps.slot).any()
    assert load_sequence(store, fid, bob, b_tokens) == (16, b_bytes)
    store.check()
    store.close()
