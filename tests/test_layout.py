"""tests/ mirrors jzero/zero/: every module there has its own test file, at the mirrored path, that imports it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_every_zero_module_has_a_test_file_that_imports_it():
    missing = []
    for module in sorted((ROOT / "jzero" / "zero").rglob("*.py")):
        if module.name == "__init__.py":
            continue
        relative = module.relative_to(ROOT / "jzero")  # zero/flat/plan.py
        test = ROOT / "tests" / relative.parent / f"test_{module.stem}.py"
        name = ".".join(("jzero", *relative.with_suffix("").parts))
        if not test.exists() or name not in imported_modules(test):
            missing.append(f"{test.relative_to(ROOT)} (importing {name})")
    assert not missing, "no direct test: " + ", ".join(missing)
