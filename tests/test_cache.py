"""The block manager's books: allocation, exactly-once release, integrity."""
import pytest

from labkit.engine.cache import BlockManager
from labkit.errors import CacheFull, DoubleFree


def test_allocation_reserves_whole_blocks_for_the_token_count():
    pool = BlockManager(num_blocks=10, block_size=4)
    table = pool.allocate("a", 9)
    assert len(table) == 3 and pool.num_free == 7 and pool.num_held == 3
    pool.check_integrity({"a"})


def test_release_returns_every_block_to_the_pool():
    pool = BlockManager(num_blocks=10, block_size=4)
    pool.allocate("a", 16)
    assert pool.deallocate("a") == 4
    assert pool.num_free == 10 and pool.num_releases == 1
    pool.check_integrity(set())


def test_second_release_of_the_same_owner_raises_double_free():
    pool = BlockManager(num_blocks=4, block_size=4)
    pool.allocate("a", 4)
    pool.deallocate("a")
    with pytest.raises(DoubleFree):
        pool.deallocate("a")
    assert pool.num_free == 4 and pool.num_releases == 1


def test_releasing_an_owner_that_never_held_blocks_raises():
    with pytest.raises(DoubleFree):
        BlockManager(num_blocks=4, block_size=4).deallocate("ghost")


def test_allocation_beyond_the_free_blocks_is_refused_with_cache_full_and_takes_nothing():
    pool = BlockManager(num_blocks=3, block_size=4)
    assert not pool.can_allocate(13)
    with pytest.raises(CacheFull, match="needs 4 blocks, 3 free"):
        pool.allocate("a", 13)
    assert pool.num_free == 3
    pool.check_integrity(set())


def test_integrity_check_catches_a_holder_that_is_not_a_live_sequence():
    pool = BlockManager(num_blocks=4, block_size=4)
    pool.allocate("a", 4)
    with pytest.raises(AssertionError, match="live sequences"):
        pool.check_integrity(set())


def test_integrity_check_catches_a_block_held_twice():
    pool = BlockManager(num_blocks=4, block_size=4)
    pool.allocate("a", 4)
    pool._tables["b"] = list(pool.table("a"))  # corrupt the books on purpose
    with pytest.raises(AssertionError, match="held twice"):
        pool.check_integrity({"a", "b"})
