"""The one wait helper: bounded, returns the answer that ended the wait, says what it waited for."""

import asyncio
import time

import pytest

from labkit.experiments.waiting import WaitTimeout, await_for, wait_for


def test_wait_for_returns_the_first_truthy_answer():
    answers = iter([None, 0, {}, {"running": 0}])
    assert wait_for(lambda: next(answers), timeout=5, what="idle", interval=0.001) == {"running": 0}


def test_wait_for_gives_up_at_its_bound_and_names_what_it_waited_for():
    start = time.monotonic()
    with pytest.raises(WaitTimeout) as caught:
        wait_for(lambda: [], timeout=0.1, what="the queue to fill", interval=0.01)
    assert 0.1 <= time.monotonic() - start < 2.0
    assert "the queue to fill" in str(caught.value) and caught.value.last == []


def test_wait_for_checks_at_least_once_even_with_a_tiny_bound():
    assert wait_for(lambda: "ready", timeout=1e-9, what="x") == "ready"


@pytest.mark.parametrize("timeout, interval", [(0, 0.1), (-1, 0.1), (1, 0), (float("nan"), 0.1), (float("inf"), 0.1)])
def test_bounds_must_be_positive(timeout, interval):
    with pytest.raises(ValueError):
        wait_for(lambda: True, timeout=timeout, what="x", interval=interval)


def test_await_for_accepts_coroutine_checks_and_lets_the_loop_run():
    async def main():
        box = []
        asyncio.get_running_loop().call_later(0.02, box.append, "done")

        async def check():
            return box[0] if box else None

        return await await_for(check, timeout=5, what="the callback", interval=0.005)

    assert asyncio.run(main()) == "done"


def test_await_for_times_out():
    with pytest.raises(WaitTimeout):
        asyncio.run(await_for(lambda: False, timeout=0.05, what="never", interval=0.01))


def test_a_check_that_hangs_is_cut_off_at_the_bound():
    async def hangs():
        await asyncio.sleep(60)

    start = time.monotonic()
    with pytest.raises(WaitTimeout):
        asyncio.run(await_for(hangs, timeout=0.1, what="a hung request", interval=0.01))
    assert time.monotonic() - start < 5
