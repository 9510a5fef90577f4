"""Plan caches build once per key, count hits, and evict least-recently-used entries."""

from libnn.runtime.cache import PlanCache, cache_info


def test_cache_builds_once_per_key_and_counts_hits():
    cache = PlanCache("test cache", maxsize=2)
    built = []
    for key in ["a", "b", "a", "a"]:
        assert cache.get(key, lambda: built.append(key) or key.upper()) == key.upper()
    assert built == ["a", "b"]
    assert (cache.stats.builds, cache.stats.hits, cache.stats.size) == (2, 2, 2)
    assert cache_info()["test cache"] is cache.stats


def test_cache_evicts_the_least_recently_used():
    cache = PlanCache("test cache lru", maxsize=2)
    for key in ["a", "b", "a", "c"]:
        cache.get(key, lambda: key)
    assert "a" in cache and "c" in cache and "b" not in cache
