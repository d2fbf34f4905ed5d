"""Every test runs on 8 simulated CPU devices (set once, here, before JAX starts).

Layout: tests/ mirrors jzero/. A module's own tests sit where the module sits (jzero/zero/flat/plan.py:
tests/zero/flat/test_plan.py; every module of jzero/zero/ has one, on the small pytree model of
`helpers.pytree`), and tests of a whole path or feature sit beside the modules they cross
(tests/zero/test_fidelity.py: every strategy and path against optax; tests/inspect/: `jzero hlo` and
`jzero memory`; tests/train/: the harness; tests/experiments/: the experiments the tests run;
tests/test_cli.py and the others at the top: jzero/cli.py, runtime.py, launch.py). pytest imports
test modules by path (pyproject: `--import-mode=importlib`), so two may share a basename, and
never one another: what tests share lives in one package, tests/helpers/ (pyproject's `pythonpath`
puts tests/ on sys.path; its modules are listed in its docstring).

`-m "not slow"` is the fast subset (under 3 minutes on 2 cores): the `slow` tests (subprocess and
multi-process runs, deviceless GPU compiles) and all but the first case of each `matrix` are left out.
The suite runs the cases of each `matrix` that cover every pair of its parameters' values;
`--thorough` runs them all (`pytest_collection_modifyitems`).

The single-device references (`helpers.reference_run`) are computed once per session and shared
by the pytest-xdist workers through a directory the controlling process makes (its environment
is the workers') and removes when it exits; so are compiled programs (JAX's compilation cache).
"""

import atexit
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
if "JZERO_TEST_REFERENCES" not in os.environ:
    os.environ["JZERO_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="jzero-test-references-")
    atexit.register(shutil.rmtree, os.environ["JZERO_TEST_REFERENCES"], ignore_errors=True)
# JAX's persistent compilation cache, for this session only (made here, removed at exit; the
# workers and the CLI subprocesses inherit it): the many tests that build the same tiny programs
# compile each once. A hit is the same executable XLA would build (the key is the program and its
# compile options), so nothing a test checks changes; `jzero hlo`'s dumps compile with options of
# their own (a fresh dump directory) and are never served from it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jzero-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The tests compile a few hundred small programs and run each a few steps: XLA:CPU's code generation
# at LLVM -O0 halves the compile time, and (jaxlib 0.10, whose XLA still has them) its elemental
# emitters in place of the MLIR fusion emitters take a third off what is left (`FAST_CODEGEN`; the
# suite 14:12 -> 9:54 on 2 cores). XLA's HLO passes (fusion, scheduling, collectives: what the HLO
# tests read) are unchanged, and every reference is computed in the same process under the same
# flags. But two differently fused programs may round differently in the last bit: at -O0 the
# host-memory update (tests/train/test_checkpoint.py runs `jzero` at the default level for it), and
# with the elemental emitters the flat path's init and an int8 code. A test that promises bitwise
# equality between two programs is marked `default_codegen`: it runs in a pytest of its own with
# XLA's default emitters (still at -O0: `pytest_pyfunc_call`).
FAST_CODEGEN = "--xla_cpu_use_fusion_emitters=false"
DEFAULT_CODEGEN_ENV = "JZERO_TEST_DEFAULT_CODEGEN"  # "1": XLA's default emitters (that pytest of its own)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
jaxlib_version = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
if jaxlib_version < (0, 11) and os.environ.get(DEFAULT_CODEGEN_ENV) != "1":
    if "fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + FAST_CODEGEN

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(autouse=True)
def _no_pause_before_a_checkpoint_read_is_retried(monkeypatch):
    """The pause before a failed checkpoint read is tried again (2 s, for a network filesystem's passing error)
    is not under test: each damaged-step test would wait it out (`jzero.train.checkpoint.READ_RETRY_S`)."""
    from jzero.train import checkpoint

    monkeypatch.setattr(checkpoint, "READ_RETRY_S", 0.0)


def pytest_addoption(parser):
    parser.addoption(
        "--thorough",
        action="store_true",
        help="run every case of each `matrix` (the suite runs a pairwise-covering subset; docs/testing.md)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A `default_codegen` test, where this process has the suite's faster code generation, runs in a
    pytest of its own with XLA's default emitters (its own references: they would differ in the last bit)."""
    if pyfuncitem.get_closest_marker("default_codegen") is None or FAST_CODEGEN not in os.environ["XLA_FLAGS"]:
        return None
    env = {k: v for k, v in os.environ.items() if k != "JZERO_TEST_REFERENCES"}
    env |= {DEFAULT_CODEGEN_ENV: "1", "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(FAST_CODEGEN, "").strip()}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    child = subprocess.run(command, cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True,
                           timeout=600)
    if child.returncode != 0:
        pytest.fail(f"at XLA's default code generation:\n{child.stdout[-6000:]}\n{child.stderr[-2000:]}", pytrace=False)
    return True


def _pairs(params: dict) -> set:
    """Every pair of (parameter, value)s of a case (each one alone when it has one parameter)."""
    values = sorted((name, value if isinstance(value, str) else repr(value)) for name, value in params.items())
    return {(a, b) for i, a in enumerate(values) for b in values[i + 1 :]} or {(v,) for v in values}


def _covering(cases: list[set]) -> set[int]:
    """Indices of a few `cases` (each a set of pairs) that together hold every pair any of them holds:
    the first, then again and again the one that adds the most pairs not yet held (the earliest of
    equals). Greedy set cover: the suite runs 864 tests where taking, in order, each case that adds
    a pair ran 884, for the same pairs (the fidelity matrix 7 cases instead of 15, MoE's 6 instead of 10)."""
    chosen, held, every = {0}, set(cases[0]), set().union(*cases)
    while held != every:
        best = max(range(len(cases)), key=lambda i: (len(cases[i] - held), -i))
        chosen.add(best)
        held |= cases[best]
    return chosen


def pytest_collection_modifyitems(config, items):
    """The three tiers of a `matrix` (a parametrized test of many combinations):

    - the fast subset (`-m "not slow"`) runs its first case;
    - the suite (CI) runs cases that cover every pair of parameter values at least once (each
      strategy with each path, each mesh with each strategy, ...), few of them (`_covering`);
    - `--thorough` runs every case (docs/testing.md).

    Then it runs the slow tests first (below)."""
    matrices: dict[tuple, list] = {}
    for item in items:
        if item.get_closest_marker("matrix") is not None:
            matrices.setdefault((item.path, item.originalname), []).append(item)
    skipped = []
    for cases in matrices.values():
        for item in cases[1:]:
            item.add_marker(pytest.mark.slow)
        if not config.getoption("thorough"):
            pairs = [_pairs(getattr(getattr(item, "callspec", None), "params", {})) for item in cases]
            chosen = _covering(pairs)
            skipped += [item for i, item in enumerate(cases) if i not in chosen]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        gone = set(skipped)
        items[:] = [item for item in items if item not in gone]
    # The slow tests first (each file's in its order): pytest-xdist hands the workers tests in this
    # order, so the two finish on short tests together instead of one waiting on a 30 s test.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
