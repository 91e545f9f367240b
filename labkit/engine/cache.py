"""The paged KV cache's books: which blocks are free and which sequence holds which.

The tensors themselves live in the runner; this module only does the accounting, so it can be
checked exhaustively. A sequence's blocks are reserved whole at admission (prompt plus every
token it may generate), which is why a running sequence never waits for memory.

Owners are the scheduler's sequence numbers, never request ids: an id comes back when a client
reuses it, a number never does, so a stale release can only raise, never free a newer request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from collections.abc import Set as AbstractSet

from labkit.errors import CacheFull, DoubleFree


class BlockManager:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self.num_releases = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, owner: Hashable, num_tokens: int) -> list[int]:
        """Reserve enough blocks for ``num_tokens`` tokens and return the owner's block table."""
        if owner in self._tables:
            raise ValueError(f"{owner!r} already holds blocks")
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            raise CacheFull(f"{owner!r} needs {needed} blocks, {len(self._free)} free")
        table = [self._free.popleft() for _ in range(needed)]
        self._tables[owner] = table
        return table

    def deallocate(self, owner: Hashable) -> int:
        """Return ``owner``'s blocks to the pool. A second call for the same owner raises DoubleFree."""
        table = self._tables.pop(owner, None)
        if table is None:
            raise DoubleFree(f"{owner!r} holds no blocks: released twice or never allocated")
        self._free.extend(table)
        self.num_releases += 1
        return len(table)

    def table(self, owner: Hashable) -> list[int]:
        return self._tables[owner]

    def check_integrity(self, live_owners: AbstractSet[Hashable]) -> None:
        """Free and held blocks partition the pool; every holder is a live sequence, and vice versa."""
        held = [b for table in self._tables.values() for b in table]
        free = list(self._free)
        assert len(set(held)) == len(held), "a block is held twice"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(held) & set(free), "a block is both free and held"
        assert set(held) | set(free) == set(range(self.num_blocks)), "a block is lost from the pool"
        assert set(self._tables) == live_owners, (
            f"holders {sorted(self._tables, key=repr)} differ from live sequences {sorted(live_owners, key=repr)}"
        )
