"""Bounded memos (pool_tuner/memo.py; docs/design.md, "Memory"): every table on the call path
shares one limit, and an owner's entries leave every table together."""

import threading

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import memo, reference

from conftest import random_input


def test_the_least_recently_used_owner_leaves_every_table_at_once():
    memos = memo.Memos(limit=2)
    kernels, plans = memos.table("kernels"), memos.table("plans")
    kernels.put("a", "ka", 1)
    plans.put("a", "pa", 2)
    kernels.put("b", "kb", 3)
    assert kernels.get("ka") == 1  # a is now more recent than b
    plans.put("c", "pc", 4)  # a third owner: b, the least recently used, goes
    assert "kb" not in kernels and kernels.get("ka") == 1 and plans.get("pa") == 2 and plans.get("pc") == 4
    kernels.put("d", "kd", 5)  # then a (used before c)
    assert "ka" not in kernels and "pa" not in plans
    assert memos.owners() == 2 and memos.sizes() == {"kernels": 1, "plans": 1}


def test_no_table_holds_more_entries_than_the_limit():
    memos = memo.Memos(limit=3)
    table = memos.table("forced")
    for config in range(10):  # ten entries of one owner
        table.put("problem", config, config)
        assert len(table) <= 3
    assert memos.owners() <= 1


def test_evicting_clearing_and_a_lower_limit():
    memos = memo.Memos(limit=4)
    one, two = memos.table("one"), memos.table("two")
    for owner in "abcd":
        one.put(owner, owner, owner.upper())
        two.put(owner, owner + "!", owner)
    memos.evict("a")
    assert "a" not in one and "a!" not in two and memos.owners() == 3
    one.clear()
    assert len(one) == 0 and len(two) == 3 and memos.owners() == 3
    memos.set_limit(1)
    assert len(two) == 1 and memos.owners() == 1
    with pytest.raises(ValueError, match="memo limit"):
        memos.set_limit(0)
    memos.clear()
    assert memos.owners() == 0 and len(two) == 0


def test_concurrent_puts_and_gets_keep_the_tables_and_the_owners_consistent():
    memos = memo.Memos(limit=5)
    tables = [memos.table(f"t{i}") for i in range(3)]
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(3000):
                owner, table = int(rng.integers(20)), tables[int(rng.integers(3))]
                value = table.get(owner)
                if value is not None and value != owner * 10:
                    errors.append((owner, value))
                table.put(owner, owner, owner * 10)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert memos.owners() <= 5 and all(len(table) <= 5 for table in tables)
    held = {owner for table in tables for owner in table.values()}
    assert held <= {owner * 10 for owner in memos._filed}


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(memo.LIMIT_ENV, "7")
    assert memo._limit_from_environment() == 7
    for bad in ("none", "0", "-3"):
        monkeypatch.setenv(memo.LIMIT_ENV, bad)
        with pytest.warns(RuntimeWarning, match=f"{memo.LIMIT_ENV}={bad!r} is not an int >= 1"):
            assert memo._limit_from_environment() == memo.DEFAULT_LIMIT


@pytest.fixture
def small_limit():
    previous = memo.limit()
    memo.set_limit(4)
    yield 4
    memo.set_limit(previous)


def test_many_shapes_through_a_small_limit_stay_within_it_and_right(rng, small_limit):
    """Every call's tables (validated problems, decisions, built programs, kernels and launches,
    per-shape facts) stay within the limit however many shapes pass, and calls stay right,
    also for a shape whose kernels were evicted and are built again."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    shapes = [(2, 3, 6 + i, 5 + i % 3) for i in range(7)]
    for shape in shapes + shapes[:2]:
        x = random_input(rng, shape)
        out = (3, 2)
        np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, out), reference.forward("adaptive_avg_pool2d", x, out),
                                   rtol=1e-5, atol=1e-6)
        grad = random_input(rng, shape[:2] + out)
        np.testing.assert_allclose(pt.adaptive_avg_pool2d_backward(grad, shape),
                                   reference.backward("adaptive_avg_pool2d", grad, shape), rtol=1e-5, atol=1e-6)
        t = torch.from_numpy(x).requires_grad_(True)
        values = ptt.AdaptiveMaxPool2d(out)(t)
        values.backward(torch.from_numpy(grad))
        expected, indices = reference.forward("adaptive_max_pool2d", x, out)
        np.testing.assert_array_equal(values.detach().numpy(), expected.astype(np.float32))
        np.testing.assert_allclose(t.grad.numpy(), reference.backward("adaptive_max_pool2d", grad, shape, indices),
                                   rtol=1e-5, atol=1e-6)
        assert memo.owners() <= small_limit
        assert all(size <= small_limit for size in memo.sizes().values()), memo.sizes()
