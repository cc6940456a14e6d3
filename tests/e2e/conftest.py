"""End-to-end tests start processes: gloo ranks (the `ranks` fixture), the CLI, torchrun. All carry the
`e2e` marker, so `-m "not e2e"` is the fast tier too."""
import pytest

from tests.e2e.rank_pool import RankPool

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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
