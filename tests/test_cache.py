"""Plan caches build once per key, count hits, and evict least-recently-used entries; the disk cache's
writes and entry locks hold up with several processes at once."""

import pytest
from conftest import outputs_of, start_together

from libnn.runtime.cache import PlanCache, cache_info, cache_keys


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


def test_cache_keys_lists_a_plan_cache_by_name_least_recent_first():
    cache = PlanCache("test cache keys", maxsize=3)
    for key in ["a", "b", "a"]:
        cache.get(key, lambda: key)
    assert cache_keys("test cache keys") == ["b", "a"]
    with pytest.raises(KeyError, match="no plan cache named 'no such cache'"):
        cache_keys("no such cache")


def test_time_paths_rows_ratios_and_declined_paths(monkeypatch):
    """The benchmarks' shared per-case loop, with the GPU timer replaced by fixed times."""
    from libnn.bench import harness
    from libnn.errors import LibraryError

    times = {"lib": 2.0, "ours": 4.0}
    monkeypatch.setattr(harness, "time_gpu", lambda fn, inputs, **kw: harness.Timing(fn(None), 0, 0, 1))
    monkeypatch.setattr(harness, "time_per_call", lambda fn, **kw: 2 * fn())  # the host doubles it

    def declined(_):
        raise LibraryError("no engine supports this graph\nthe backend log")

    paths = {"lib": lambda _: times["lib"], "ours": lambda _: times["ours"], "other lib": declined}
    ceilings = harness.Ceilings("toy", copy_gbs=1.0, gemm_bf16_tflops=1.0)
    rows = harness.time_paths(paths, {"case": "c"}, flops=int(2e9), ceilings=ceilings, baseline="lib",
                              errors=(LibraryError,))
    assert [r["path"] for r in rows] == ["lib", "ours", "other lib"] and all(r["case"] == "c" for r in rows)
    assert rows[0]["TFLOP/s"] == 2e9 / 2e-3 / 1e12 and rows[1]["lib/x"] == 0.5
    assert rows[0]["per-call ms"] == 4.0 and rows[1]["per-call ms"] == 8.0
    assert rows[2]["note"] == "no engine supports this graph" and "ms" not in rows[2]


def test_concurrent_atomic_writes_leave_one_whole_entry_and_readers_see_no_part(tmp_path):
    """Processes writing one disk-cache entry at once (pytest-xdist workers share the cache) each replace it
    whole: a reader finds one writer's full contents every time, and no temporary file is left."""
    entry = tmp_path / "cache" / "plan.bin"
    writers = start_together(tmp_path, f"""
        from libnn.runtime.cache import write_atomically
        entry, me = pathlib.Path({str(entry)!r}), os.getpid()
        go()
        for i in range(200):
            write_atomically(entry, (b"%d:" % me) * 100_000)  # 0.6-0.8 MB: a plain write shows its halves
    """, processes=4)
    seen = set()
    while any(w.poll() is None for w in writers):
        if entry.exists():
            data = entry.read_bytes()
            head = data.split(b":")[0] + b":"
            assert data == head * 100_000, f"a reader saw a partial entry ({len(data)} bytes)"
            seen.add(head)
    outputs_of(writers)
    assert len(seen) >= 1 and [p.name for p in entry.parent.iterdir()] == ["plan.bin"]


def test_entry_lock_lets_one_process_in_at_a_time(tmp_path):
    """Inside `entry_lock` each process has the entry to itself: none enters while another is inside."""
    journal = tmp_path / "journal"
    children = start_together(tmp_path, f"""
        from libnn.runtime.cache import entry_lock
        journal, me = pathlib.Path({str(journal)!r}), os.getpid()
        go()
        for _ in range(20):
            with entry_lock(pathlib.Path({str(tmp_path / "entry.lock")!r})):
                with open(journal, "a") as f:
                    f.write(f"in {{me}}\\n")
                time.sleep(0.002)
                with open(journal, "a") as f:
                    f.write(f"out {{me}}\\n")
    """, processes=4)
    outputs_of(children)
    lines = journal.read_text().splitlines()
    assert len(lines) == 4 * 20 * 2
    for enter, leave in zip(lines[::2], lines[1::2]):
        assert enter.startswith("in ") and leave == "out " + enter[3:], "two processes held the lock at once"
