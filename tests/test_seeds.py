"""The rng fixture: fixed by default (a failure reproduces by running again), different per test, and
fresh on request with the seed printed."""

import os
import subprocess
import sys

SAMPLE = '''
def test_a(rng):
    print("drew", rng.integers(0, 2**62))

def test_b(rng):
    print("drew", rng.integers(0, 2**62))
'''


def draws(tmp_path, *args: str, seed: str | None = None) -> tuple[list[str], str]:
    """The numbers test_a and test_b drew in one pytest run of SAMPLE under this conftest, and its output."""
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "LIBNN_TEST_SEED"}
    if seed is not None:
        env["LIBNN_TEST_SEED"] = seed
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist",
                             *args, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("drew")], result.stdout


def test_default_seed_is_fixed_and_differs_between_tests(tmp_path):
    first, _ = draws(tmp_path)
    again, _ = draws(tmp_path)
    assert len(first) == 2 and first == again and first[0] != first[1]


def test_a_random_seed_is_printed_and_reproduces(tmp_path):
    fixed, _ = draws(tmp_path)
    fresh, out = draws(tmp_path, "--random-seed")
    assert fresh != fixed
    seed = out.split("LIBNN_TEST_SEED=")[1].split()[0].rstrip(")")
    assert draws(tmp_path, seed=seed)[0] == fresh
    assert draws(tmp_path, seed="random")[0] != fresh


def test_a_bad_seed_is_refused(tmp_path):
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "LIBNN_TEST_SEED": "abc"}, cwd=tmp_path)
    assert result.returncode != 0 and "LIBNN_TEST_SEED must be a non-negative integer or 'random', got 'abc'" in \
        result.stdout + result.stderr
