"""The pass plan: its numbers, its attention work items, its checks, and how the runtime hands it over."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from pie.contract import PassPlan
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.runtime.pass_plan import check_page_table_values, check_slot_values, sequence_lengths
from pie.testing.conformance import plan_of_batch, random_batch
from pie.testing.models import random_weights, tiny_config

I32 = np.int32


def _plan(qo: list[int], page_indptr: list[int], last: list[int], page_size: int = 16) -> PassPlan:
    batch = {"qo_indptr": np.array(qo, I32), "kv_page_indices": np.arange(page_indptr[-1], dtype=I32),
             "kv_page_indptr": np.array(page_indptr, I32), "kv_last_page_lens": np.array(last, I32)}
    return plan_of_batch(batch, page_size)


def test_lengths_maxima_and_decode_flag_of_a_ragged_batch() -> None:
    plan = _plan([0, 2, 3, 3], [0, 3, 4, 4], [2, 16, 0])
    assert plan.q_lens.tolist() == [2, 1, 0]
    assert plan.kv_lens.tolist() == [34, 16, 0], "a sequence without pages reads no key"
    assert (plan.max_q_len, plan.max_kv_len, plan.num_tokens, plan.num_sequences) == (2, 34, 3, 3)
    assert not plan.decode_only
    assert plan.positions.tolist() == [32, 33, 15]
    assert plan.q_lens.dtype == plan.kv_lens.dtype == I32


def test_decode_only_means_one_new_token_for_every_sequence() -> None:
    assert _plan([0, 1, 2], [0, 1, 3], [5, 1]).decode_only
    assert not _plan([0, 0, 2], [0, 1, 3], [5, 1]).decode_only, "two tokens for two sequences, one of them empty"
    assert not _plan([0], [0], []).decode_only, "a pass of no sequence"


def test_query_tiles_cut_each_sequence_in_order() -> None:
    plan = _plan([0, 40, 41, 41, 50], [0, 3, 4, 4, 5], [8, 1, 0, 9])
    tiles = plan.query_tiles(16)
    assert tiles.tolist() == [[0, 0, 16], [0, 16, 16], [0, 32, 8], [1, 40, 1], [3, 41, 9]]
    assert tiles.dtype == I32
    assert _plan([0], [0], []).query_tiles(16).shape == (0, 3)


def test_key_chunks_cover_each_tokens_visible_keys() -> None:
    plan = _plan([0, 1, 3], [0, 3, 4], [88, 5], page_size=256)
    items, item_ptr = plan.key_chunks(256)
    assert item_ptr.tolist() == [0, 3, 4, 5]
    assert items.tolist() == [[0, 0, 256], [0, 256, 512], [0, 512, 600], [1, 0, 4], [2, 0, 5]]
    assert items.dtype == item_ptr.dtype == I32


def test_key_chunks_start_at_each_tokens_sliding_window() -> None:
    plan = _plan([0, 1, 3], [0, 3, 4], [88, 5], page_size=256)
    items, item_ptr = plan.key_chunks(256, window=300)
    assert item_ptr.tolist() == [0, 2, 3, 4]
    assert items.tolist() == [[0, 300, 556], [0, 556, 600], [1, 0, 4], [2, 0, 5]], "a window longer than the keys"


@pytest.mark.parametrize("seed", range(6))
def test_work_items_match_a_loop_over_every_token(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 4, 16]))
    plan = plan_of_batch(random_batch(rng, page_size, 64, max_seqs=5, decode=seed % 3 == 0), page_size)
    block, chunk, window = int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(0, 12))
    tiles, chunks = [], []
    for b in range(plan.num_sequences):
        start, stop = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        tiles += [[b, first, min(block, stop - first)] for first in range(start, stop, block)]
        for t in range(start, stop):
            visible = int(plan.kv_lens[b]) - (stop - start) + (t - start) + 1
            first = max(0, visible - window) if window else 0
            chunks.append([[t, k, min(k + chunk, visible)] for k in range(first, visible, chunk)])
    assert plan.query_tiles(block).tolist() == tiles
    items, item_ptr = plan.key_chunks(chunk, window)
    assert items.tolist() == [item for token in chunks for item in token]
    assert item_ptr.tolist() == np.cumsum([0] + [len(token) for token in chunks]).tolist()


def test_sequence_lengths_of_the_page_tables() -> None:
    q_lens, kv_lens = sequence_lengths(np.array([0, 3, 4], I32), np.array([0, 2, 2], I32), np.array([1, 0], I32), 4)
    assert q_lens.tolist() == [3, 1] and kv_lens.tolist() == [5, 0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qo_indptr": np.array([0, 3, 2], I32)}, "never decrease"),
        ({"qo_indptr": np.array([1, 3, 4], I32)}, "qo_indptr must start at 0"),
        ({"kv_last_page_lens": np.array([4], I32)}, "describes 2 sequences, kv_page_indptr 2 and kv_last_page_lens 1"),
        ({"kv_last_page_lens": np.array([5, 1], I32)}, r"kv_last_page_lens must be in 1\.\.4"),
        ({"kv_page_indices": np.arange(2, dtype=I32)}, "kv_page_indptr ends at 3, for 2 page indices"),
        ({"ids": np.zeros(3, I32)}, "qo_indptr ends at 4, for 3 ids"),
        ({"slots": np.zeros(4, np.int64)}, "slots must be a one-dimensional int32 array, not 1-D int64"),
        ({"positions": [0, 1, 2, 3]}, "positions must be a one-dimensional int32 array, not list"),
        ({"kv_page_indptr": np.array([0, 1, 3], I32), "kv_last_page_lens": np.array([1, 4], I32)},
         "more new tokens than its pages hold"),
        ({"page_size": 0}, "page_size must be at least 1"),
    ],
)
def test_an_inconsistent_batch_is_named(change: dict, message: str) -> None:
    plan = _plan([0, 3, 4], [0, 2, 3], [2, 4], page_size=4)
    arrays = {f.name: getattr(plan, f.name) for f in fields(plan)}
    given = {k: arrays[k] for k in ("ids", "positions", "slots", "qo_indptr", "kv_page_indices", "kv_page_indptr",
                                     "kv_last_page_lens", "sample_rows", "page_size")}
    with pytest.raises(ValueError, match=message):
        PassPlan.from_batch(**{**given, **change})


def test_page_table_values_are_checked_against_the_query_rows_and_the_pool() -> None:
    """What an engine whose kernels follow page ids unbounded checks of a launch's tables (the CPU engine's
    native attention, on refusing them): the rows its query has, and the pages its pool has."""
    tables = [np.array(values, I32) for values in ([0, 3, 4], [5, 0, 7], [0, 2, 3], [2, 4])]
    check_page_table_values("attention", *tables, 4, rows=4, num_pages=8)
    with pytest.raises(ValueError, match="attention: qo_indptr ends at 4, for 5 query rows"):
        check_page_table_values("attention", *tables, 4, rows=5, num_pages=8)
    with pytest.raises(ValueError, match="attention: kv_page_indices holds page 7, outside the pool's 7 pages"):
        check_page_table_values("attention", *tables, 4, rows=4, num_pages=7)
    tables[1][1] = -2
    with pytest.raises(ValueError, match="attention: kv_page_indices holds page -2, outside the pool's 8 pages"):
        check_page_table_values("attention", *tables, 4, num_pages=8)


def test_slots_are_checked_against_the_pool() -> None:
    check_slot_values("append_kv", np.array([0, 31], I32), 4, 8)
    for slot in (32, -1):
        with pytest.raises(ValueError, match=f"append_kv: slot {slot} is outside the pool's 8 pages of 4 tokens"):
            check_slot_values("append_kv", np.array([0, slot, 40], I32), 4, 8)


@pytest.fixture(scope="module")
def runner():
    config = tiny_config()
    device = EngineRegistry(env={}).select("cpu")[0]
    runner = ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=128)
    yield runner
    runner.close()


def test_prepare_plans_the_pass_it_describes(runner: ModelRunner) -> None:
    first, second = runner.new_sequence(), runner.new_sequence()
    runner.step([SequenceWork(first, [5, 6, 7, 8, 9])])
    batch = runner.prepare([SequenceWork(first, [3]), SequenceWork(second, [1, 2, 3], all_logits=True)])
    plan = batch.plan
    assert plan is not None
    assert plan.qo_indptr is batch.qo_indptr and plan.ids is batch.ids, "the plan holds the batch's own arrays"
    derived = runner.plan_of(type(batch)(**{f.name: getattr(batch, f.name) for f in fields(batch)}))
    for name in ("q_lens", "kv_lens", "positions", "slots", "sample_rows"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(derived, name), err_msg=name)
    assert (plan.max_q_len, plan.max_kv_len, plan.num_tokens, plan.decode_only, plan.page_size) == (3, 6, 4, False, 4)
    assert (derived.max_q_len, derived.max_kv_len, derived.num_tokens, derived.decode_only) == (3, 6, 4, False)
    runner.forward(batch)


def test_a_batch_without_a_plan_is_checked_against_the_pool(runner: ModelRunner) -> None:
    """A batch given as arrays alone (a replica's follower builds them so) was planned without the pool's size: a
    page index of -1 reached the numpy attention, which read another sequence's page through it."""
    seq = runner.new_sequence()
    batch = runner.prepare([SequenceWork(seq, [5, 6, 7])])
    arrays = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name != "plan"}
    pages = runner.pages.num_pages
    for change, message in (
        ({"kv_page_indices": np.full_like(batch.kv_page_indices, -1)}, f"holds page -1, outside the pool's {pages}"),
        ({"kv_page_indices": np.full_like(batch.kv_page_indices, pages)}, f"holds page {pages}, outside the pool's"),
        ({"slots": np.full_like(batch.slots, -1)}, f"slot -1 is outside the pool's {pages} pages of 4 tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            runner.plan_of(type(batch)(**{**arrays, **change}))
    runner.forward(batch)  # the batch as prepared runs


def test_each_pass_is_begun_with_its_plan_and_ended_even_when_it_fails(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(runner.device, "begin_pass", lambda plan: calls.append(plan))
    monkeypatch.setattr(runner.device, "end_pass", lambda: calls.append("end"))
    sequence = runner.new_sequence()
    batch = runner.prepare([SequenceWork(sequence, [1, 2], logits=False)])
    runner.forward(batch)
    assert len(calls) == 2 and calls[1] == "end"
    handed = calls[0]
    assert isinstance(handed, PassPlan) and handed.sample_rows.tolist() == [1], (
        "a pass sampling no row computes its last one, and its plan says so"
    )
    calls.clear()
    batch = runner.prepare([SequenceWork(sequence, [4])])
    assert batch.plan is not None and batch.plan.decode_only
    monkeypatch.setattr(runner.device, "upload", lambda array: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.forward(batch)
    assert calls == [batch.plan, "end"]
