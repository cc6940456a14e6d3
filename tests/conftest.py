import pytest

from tests.rank_pool import RankPool

_pools: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    pool = _pools.get(world)
    if pool is None or pool.broken:
        pool = _pools[world] = RankPool(world)
    return pool


@pytest.fixture
def ranks():
    """`ranks(world)` -> a live RankPool of that many gloo processes (shared across tests)."""
    return _pool


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
