"""Tail pages: the partial last page of a sequence is stored, matched, restored and dropped
like a whole page, on real files, shared memory and SQLite."""

from __future__ import annotations

import numpy as np

from dss.types import PUBLIC_TENANT
from tests.store_helpers import SMALL_FP, load_sequence, open_store, page_bytes, pages_for, put_sequence

BS = SMALL_FP.block_size  # 4


def with_tail(tokens: np.ndarray, salt: int = 0) -> list[bytes]:
    """Whole pages of `tokens`, then a page for the tokens after them."""
    return [*pages_for(SMALL_FP, tokens, salt), page_bytes(SMALL_FP, 10_000 + len(tokens) + salt)]


def test_a_sequence_ending_inside_a_page_is_matched_to_its_last_token(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    tokens = np.arange(1, 23, dtype=np.int32)  # 5 whole pages + 2 tokens
    pages = with_tail(tokens)
    assert put_sequence(store, fid, alice, tokens, pages) == 6
    assert put_sequence(store, fid, alice, tokens, pages) == 0  # the tail is content-addressed too

    longer = np.concatenate([tokens, [900, 901, 902, 903, 904]]).astype(np.int32)
    m = store.kv.match(fid, alice, longer)
    assert (m.n_tokens, m.partial_tokens, len(m.pages)) == (22, 2, 6)
    n, got = load_sequence(store, fid, alice, longer)
    assert n == 22 and got == pages

    # A query that leaves the tail's tokens, or stops inside them, gets the tokens it shares:
    # the tail page serves any prefix of its tokens.
    assert store.kv.match(fid, alice, np.concatenate([tokens[:21], [7]]).astype(np.int32)).n_tokens == 21
    assert store.kv.match(fid, alice, tokens[:21]).n_tokens == 21
    assert store.kv.match(fid, alice, np.concatenate([tokens[:20], [7]]).astype(np.int32)).n_tokens == 20
    assert store.kv.lookup.residency(fid, alice, longer)["host"] == 22
    store.check()
    store.close()


def test_the_longest_tail_under_a_page_wins_and_short_sequences_have_root_tails(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    base = np.arange(1, 9, dtype=np.int32)  # 2 whole pages
    one = np.concatenate([base, [50]]).astype(np.int32)
    three = np.concatenate([base, [50, 51, 52]]).astype(np.int32)
    other = np.concatenate([base, [60, 61]]).astype(np.int32)
    for seq, salt in ((one, 1), (three, 2), (other, 3)):
        put_sequence(store, fid, alice, seq, with_tail(seq, salt))
    q = np.concatenate([three, [99, 98]]).astype(np.int32)
    assert store.kv.match(fid, alice, q).n_tokens == 11
    assert store.kv.match(fid, alice, np.concatenate([base, [50, 51, 7]]).astype(np.int32)).n_tokens == 10
    assert store.kv.match(fid, alice, np.concatenate([other, [1]]).astype(np.int32)).n_tokens == 10

    short = np.asarray([70, 71, 72], dtype=np.int32)  # under one page: a tail of the root
    put_sequence(store, fid, alice, short, [page_bytes(SMALL_FP, 7)])
    assert store.kv.match(fid, alice, np.asarray([70, 71, 72, 73, 74], dtype=np.int32)).n_tokens == 3
    assert store.kv.match(fid, store.identity.tenant_for("bob"), short).n_tokens == 0  # tenants never share
    store.check()
    store.close()


def test_tail_pages_survive_a_restart_from_disk(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    tokens = np.arange(1, 16, dtype=np.int32)  # 3 whole pages + 3 tokens
    pages = with_tail(tokens)
    put_sequence(store, fid, alice, tokens, pages)
    short = np.asarray([40, 41], dtype=np.int32)
    put_sequence(store, fid, alice, short, [page_bytes(SMALL_FP, 99)])
    assert store.flush()
    store.close()

    store = open_store(tmp_path)
    assert store.recovery_report is not None and store.recovery_report.pages_indexed == 5
    assert store.kv.lookup.residency(fid, alice, tokens)["disk"] == 15
    n, got = load_sequence(store, fid, alice, np.concatenate([tokens, [5]]).astype(np.int32))
    assert n == 15 and got == pages
    assert load_sequence(store, fid, alice, short) == (2, [page_bytes(SMALL_FP, 99)])
    store.check()
    store.close()


def test_a_dropped_page_takes_the_tails_after_it(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    tokens = np.arange(1, 11, dtype=np.int32)  # 2 whole pages + 2 tokens
    put_sequence(store, fid, alice, tokens, with_tail(tokens))
    m = store.kv.match(fid, alice, tokens)
    assert m.partial_tokens == 2
    store.kv.lookup.forget(store.pages.copies.drop([m.pages[1]]))  # the page before the tail leaves
    after = store.kv.match(fid, alice, tokens)
    assert after.n_tokens == 4 and not store.pages.table.contains(m.pages[2])
    store.check()

    # Erasure takes tails along with everything else of the user.
    put_sequence(store, fid, alice, tokens, with_tail(tokens))
    assert store.kv.match(fid, alice, tokens).n_tokens == 10
    receipt = store.eraser.erase_user("alice")
    assert store.eraser.verify(receipt.id).remnants == 0
    assert store.kv.match(fid, store.identity.tenant_for("alice"), tokens).n_tokens == 0
    store.check()
    store.close()


def test_a_tail_after_a_public_prefix_is_private(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    system = np.arange(500, 508, dtype=np.int32)  # two public pages
    store.prefixes.register(fid, system, text="system prompt", pin=True)
    put_sequence(store, fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    chat = np.concatenate([system, [1, 2]]).astype(np.int32)
    plan = store.kv.plan_save(fid, alice, chat, 2, with_tail=True)
    assert [p.page_index for p in plan.pages] == [2]  # the public pages are there already
    for ps in plan.pages:
        assert ps.slot is not None
        store.pages.host.slot_array(ps.slot)[:] = np.frombuffer(page_bytes(SMALL_FP, 5), dtype=np.uint8)
    assert store.kv.saves.commit_save(plan.save_id, [2]) == 1
    assert store.kv.match(fid, alice, chat).n_tokens == 10
    assert store.kv.match(fid, bob, chat).n_tokens == 8  # the public prefix only
    store.check()
    store.close()


def test_deleting_a_session_drops_its_tail_but_not_a_kept_one(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    shared = np.arange(1, 9, dtype=np.int32)
    a = np.concatenate([shared, [30, 31]]).astype(np.int32)
    b = np.concatenate([shared, [40]]).astype(np.int32)
    put_sequence(store, fid, alice, a, with_tail(a, 1))
    put_sequence(store, fid, alice, b, with_tail(b, 2))
    for sid, seq in (("a", a), ("b", b)):
        store.versions.create_session("alice", sid)
        store.versions.commit(
            "alice", sid, tokens=seq, messages=[], branch="main", expected_head=0, fingerprint=fid
        )
    store.sessions.delete("alice", "a")
    assert store.kv.match(fid, alice, a).n_tokens == 8
    assert store.kv.match(fid, alice, b).n_tokens == 9
    store.check()
    store.close()


def test_a_namespace_holding_only_tails_is_matched(tmp_path):
    # Its trie is empty (every sequence is shorter than a page); an empty trie must still count.
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    put_sequence(store, fid, alice, np.asarray([5, 6], dtype=np.int32), [page_bytes(SMALL_FP, 1)])
    assert store.kv.match(fid, alice, np.asarray([5, 6, 7], dtype=np.int32)).n_tokens == 2
    store.close()


def test_a_stale_private_path_cut_keeps_other_namespaces_tails_under_a_public_page() -> None:
    """A user's trie holds the public pages at the head of their paths. Cutting a stale path of
    that trie (its hashes changed when a public prefix was registered) must not take the tails
    other tenants, or the public namespace, keep under a public page that stays."""
    from dss.index.hashing import chain_hashes
    from dss.index.prefix_index import PrefixIndex
    from dss.index.tails import tail_hash
    from dss.namespace import make_namespace, public_namespace

    fid = SMALL_FP.id
    index = PrefixIndex()
    pub, alice, bob = public_namespace(fid), make_namespace(fid, "alice"), make_namespace(fid, "bob")
    head = np.arange(1, 9, dtype=np.int32)  # two public pages
    q = chain_hashes(pub.id, head, BS)
    index.insert(pub, BS, head, q)
    a3 = np.concatenate([head, [20, 21, 22, 23]]).astype(np.int32)
    index.insert(alice, BS, a3, [*q, *chain_hashes(alice.id, a3, BS, parent=q[-1], start_page=2)])
    for ns, extra in ((bob, [30]), (pub, [40, 41])):
        tokens = np.concatenate([head, extra]).astype(np.int32)
        index.insert(ns, BS, tokens, [*q, tail_hash(ns.id, q[-1], np.asarray(extra, dtype=np.int32))])
    alice_tail = np.concatenate([head, [50]]).astype(np.int32)
    index.insert(alice, BS, alice_tail, [*q, tail_hash(alice.id, q[-1], np.asarray([50], dtype=np.int32))])

    # Alice's path through the same tokens now hashes differently from page 1 on.
    stale = [q[0], *chain_hashes(alice.id, head, BS, parent=q[0], start_page=1)]
    dropped = index.insert(alice, BS, head, stale)
    assert index.match(fid, "bob", np.concatenate([head, [30, 0]]).astype(np.int32)).partial_tokens == 1
    assert index.match(fid, "carol", np.concatenate([head, [40, 41]]).astype(np.int32)).partial_tokens == 2
    assert index.match(fid, "alice", alice_tail).partial_tokens == 0  # hers went with her stale path
    assert len(dropped) == 2  # her page after the public ones, and her tail under them
    index.check()


def test_a_whole_page_serves_the_tokens_a_prompt_shares_with_it(tmp_path):
    """A prompt that ends, or turns away, inside a stored whole page (the same question asked
    again after a long answer, an edited last message) reuses the tokens it shares with it."""
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    tokens = np.arange(1, 17, dtype=np.int32)  # 4 whole pages
    pages = pages_for(SMALL_FP, tokens)
    put_sequence(store, fid, alice, tokens, pages)
    assert store.kv.match(fid, alice, tokens[:10]).n_tokens == 10  # ends inside page 2
    edited = np.concatenate([tokens[:9], [99, 98, 97, 96]]).astype(np.int32)
    m = store.kv.match(fid, alice, edited)
    assert (m.n_tokens, m.partial_tokens, len(m.pages)) == (9, 1, 3)
    n, got = load_sequence(store, fid, alice, edited)
    assert n == 9 and got == pages[:3]  # the third page's bytes, used for its first token

    # A sibling branch: the prompt leaves the stored path inside the first page of a child.
    other = np.concatenate([tokens[:8], [9, 10, 50, 51, 52]]).astype(np.int32)
    put_sequence(store, fid, alice, other, pages_for(SMALL_FP, other, salt=3)[:3])
    q = np.concatenate([tokens[:8], [9, 10, 11, 7]]).astype(np.int32)
    assert store.kv.match(fid, alice, q).n_tokens == 11  # tokens 9-11 of the first branch's page
    store.check()
    store.close()
