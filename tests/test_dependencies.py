"""What the tests import is what the README's test command installs, nothing a developer's machine
happens to hold.

`.ci/run` builds a fresh virtualenv and runs the README's test command in it, so a test needing a
package no extra names fails there; this test says which module and which file, on any machine.
Every third-party module imported by `tests/` (and by the experiments the tests run) must come from
the closure of `jzero[<the README's extras>]`'s requirements; a `pytest.importorskip` must name the
extra that provides its module in its reason.
"""

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    """The README's test command: the first `pip install ...` line of the README that runs pytest."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("pip install") and "pytest" in line:
            return line.split("  #")[0].strip()
    raise AssertionError("README.md has no `pip install ... pytest` line")


def readme_extras() -> set[str]:
    (extras,) = re.findall(r"\.\[([a-z0-9,_-]+)\]", readme_test_command())
    return set(extras.split(","))


def requirement_closure(root: str, extras: set[str]) -> set[str]:
    """Canonical names of the distributions `root[extras]` pulls in, as installed here."""
    seen: set[str] = set()
    todo = [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue  # an optional dependency this platform does not install (a marker excluded it)
        for text in requires:
            req = Requirement(text)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return {key for key, _ in seen}


def local_modules() -> set[str]:
    """jzero, and the modules and packages of tests/ (at any depth: it mirrors jzero/) and experiments/."""
    names = {"jzero", "conftest"}
    for folder in (ROOT / "tests", *sorted((ROOT / "experiments").iterdir())):
        if folder.is_dir():
            names |= {p.stem for p in folder.rglob("*.py")} | {p.parent.name for p in folder.rglob("__init__.py")}
    return names


def imports(path: Path) -> dict[str, str]:
    """Top-level module -> how `path` imports it ("import" or the importorskip reason)."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update({a.name.split(".")[0]: "import" for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found[node.module.split(".")[0]] = "import"
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
            module = node.args[0].value.split(".")[0]
            reason = next((k.value.value for k in node.keywords if k.arg == "reason"), "")
            found[module] = reason
    return found


def files_the_tests_run() -> list[Path]:
    """tests/**/*.py and the experiments' scripts that a test runs."""
    tests = sorted((ROOT / "tests").rglob("*.py"))
    text = "\n".join(p.read_text() for p in tests)
    run = [p for p in sorted((ROOT / "experiments").glob("*/*.py")) if f'"{p.parent.name}" / "{p.name}"' in text]
    return tests + run


def test_every_module_the_tests_import_comes_from_the_readme_extras():
    extras = readme_extras()
    closure = requirement_closure("jzero", extras)
    providers = md.packages_distributions()
    local = local_modules()
    problems = []
    for path in files_the_tests_run():
        for module, how in imports(path).items():
            if module in sys.stdlib_module_names or module in local:
                continue
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            where = path.relative_to(ROOT)
            if not dists & closure:
                problems.append(f"{where} imports {module}, which no extra of `{readme_test_command()}` installs")
            elif how != "import" and not any(f"[{e}]" in how or f".[{e}" in how for e in extras):
                problems.append(f"{where}: importorskip({module!r}) must name its extra in its reason")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_module_outside_the_extras(tmp_path):
    """The closure is real: a package the README's extras do not pull in is outside it."""
    closure = requirement_closure("jzero", readme_extras())
    assert {"jax", "optax", "orbax-checkpoint", "pytest", "ruff", "tokenizers"} <= closure
    assert "torch" not in closure and "jzero" in closure
    assert requirement_closure("jzero", set()) < closure  # the extras add to the base requirements


def test_ci_runs_the_readme_command_in_a_fresh_virtualenv():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "README.md" in ci
    assert "grep -m1 '^pip install.*pytest' README.md" in ci  # the command it runs is the README's own
    assert not re.search(r"^\s*(python3? -m )?pip install", ci, re.M)  # and it installs nothing else
