"""Dataset owners in the state store, on both backends: each owner's own name and size for a
shared (content-addressed) dataset, and an owner's stored bytes counted once per dataset."""

from __future__ import annotations

from tests.support.stores import make_store

A, B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def test_names_are_per_owner_and_bytes_add_up_per_owner(tmp_path) -> None:
    store = make_store(tmp_path)
    store.add_dataset_owner(A, "alice", name="alice.jsonl", size_bytes=100)
    store.add_dataset_owner(A, "bob", name="guess.jsonl", size_bytes=100)
    store.add_dataset_owner(B, "alice", name="b.jsonl", size_bytes=30)
    store.add_dataset_owner(A, "alice", name="renamed.jsonl", size_bytes=100)  # the same bytes again: once
    assert store.dataset_name(A, "alice") == "renamed.jsonl" and store.dataset_name(A, "bob") == "guess.jsonl"
    assert store.dataset_name(B, "bob") is None
    assert (store.dataset_bytes("alice"), store.dataset_bytes("bob"), store.dataset_bytes("carol")) == (130, 100, 0)
    assert store.dataset_visible(A, "bob") and not store.dataset_visible(B, "bob")
