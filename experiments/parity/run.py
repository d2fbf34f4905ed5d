"""Parity check: the compiled HLO summaries and the training metrics of commit --base against the working tree.

    python experiments/parity/run.py --base e3f7b9a [--out experiments/parity]

Each side runs jzero from its own source (PYTHONPATH and cwd = that tree); the base side from a temporary
`git worktree`, removed at the end. Writes OUT/result.json, OUT/base_hlo_{spec,flat}.json and
OUT/base_metrics.json; exits 0 when every check is equal, 1 otherwise. See README.md beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the working tree this script lives in: the "current" side
PATHS = ("spec", "flat")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
HLO_ARGS = ["hlo", "configs/llama2_7b.yaml", "--target", "h100", "--topology", "1 x 1 x 8"]
TRAIN_SETTINGS = [
    "train.steps=6", "train.microbatches=2", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2"
]  # fmt: skip
# Wall-clock fields: never compared.
HLO_IGNORE = {"compile_s"}
TRAIN_IGNORE = {"step_time_s", "tokens_per_s", "compile_s", "mean_step_time_s"}
# XLA's and JAX's names of instructions, computations and source functions: reported, but not a failure
# (moving or renaming a function changes them; the numbers beside them are what must match).
HLO_NAMES = {"entry", "computation", "value", "origin", "op_name", "function"}
MAX_DIFFS = 100  # per check in result.json
NOISE = ("absl::InitializeLog", "cudart_stub", "Could not find cuda drivers")


def sh(*cmd: str, cwd: Path = ROOT) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def python(tree: Path, args: list[str], **kw) -> subprocess.CompletedProcess:
    """`python ARGS` importing jzero from `tree`'s source: PYTHONPATH and cwd = tree (before the editable install)."""
    return subprocess.run([sys.executable, *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, **kw)


def jzero(tree: Path, args: list[str], log: Path) -> str | None:
    """Runs `python -m jzero.cli ARGS` from `tree`'s source; None on success, else the output's tail."""
    with log.open("w") as f:
        rc = python(tree, ["-m", "jzero.cli", *args], stdout=f, stderr=f).returncode
    if rc == 0:
        return None
    text = log.read_text()
    for where, name in ((tree, "<tree>"), (log.parent.parent, "<tmp>"), (Path(sys.prefix), "<python>")):
        text = text.replace(str(where), name)  # no machine paths in result.json
    lines = [line for line in text.splitlines() if not any(n in line for n in NOISE)]
    return f"exit {rc}: " + "\n".join(lines[-12:])


def tree_state(tree: Path) -> dict:
    """HEAD, changed tracked files and a digest of jzero/ and configs/: did the tree change while it ran?"""
    digest = hashlib.sha256()
    for f in sorted(f for d in ("jzero", "configs") for f in (tree / d).rglob("*") if f.is_file()):
        if "__pycache__" not in f.parts:
            digest.update(f"{f.relative_to(tree)}\0".encode() + f.read_bytes() + b"\0")
    changed = sh("git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no", cwd=tree)
    return {"head": sh("git", "rev-parse", "HEAD", cwd=tree), "changed_files": len(changed.splitlines()),
            "source_sha256": digest.hexdigest()}  # fmt: skip


def check_source(tree: Path) -> str:
    out = python(tree, ["-c", "import jzero; print(jzero.__file__)"], capture_output=True, text=True)
    file = Path(out.stdout.strip() or "?").resolve()
    if not file.is_relative_to(tree.resolve()):
        raise SystemExit(f"jzero imports from {file}, not from {tree}: {out.stderr.strip()[-500:]}")
    return str(file.relative_to(tree.resolve()))


def run_side(tree: Path, tmp: Path) -> dict:
    """{"hlo/<path>": doc | error, "train/<path>/<strategy>": {"metrics", "summary"} | error} for one tree."""
    tmp.mkdir(parents=True)
    out = {}
    for path in PATHS:
        t0, name, json_file = time.time(), f"hlo/{path}", tmp / f"hlo_{path}.json"
        err = jzero(tree, [*HLO_ARGS, "--path", path, "--json", str(json_file)], tmp / f"hlo_{path}.log")
        out[name] = {"error": err} if err else json.loads(json_file.read_text())
        print(f"  {name:32} {time.time() - t0:6.1f} s{'  ERROR' if err else ''}", flush=True)
    for path in PATHS:
        for strategy in STRATEGIES:
            t0, name, run_dir = time.time(), f"train/{path}/{strategy}", tmp / f"train_{path}_{strategy}"
            sets = [*TRAIN_SETTINGS, f"zero.path={path}", f"zero.strategy={strategy}"]
            args = ["train", "--quiet", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)]]
            err = jzero(tree, args, tmp / f"train_{path}_{strategy}.log")
            if err:
                out[name] = {"error": err}
            else:
                metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                out[name] = {"metrics": metrics, "summary": json.loads((run_dir / "summary.json").read_text())}
            print(f"  {name:32} {time.time() - t0:6.1f} s{'  ERROR' if err else ''}", flush=True)
    return out


def diff(a, b, ignore: set, names: set, at: str = "") -> tuple[list, list]:
    """(differences, name differences) between two JSON values, as {"field", "base", "current"}."""
    if isinstance(a, dict) and isinstance(b, dict):
        found, named = [], []
        for k in sorted(set(a) | set(b), key=str):
            if k in ignore:
                continue
            field = f"{at}.{k}" if at else str(k)
            if k not in a or k not in b:
                found.append({"field": field, "base": a.get(k, "<absent>"), "current": b.get(k, "<absent>")})
                continue
            d, n = diff(a[k], b[k], ignore, names, field)
            (named if k in names else found).extend(d)
            named.extend(n)
        return found, named
    if isinstance(a, list) and isinstance(b, list):
        found = [] if len(a) == len(b) else [{"field": f"{at}.length", "base": len(a), "current": len(b)}]
        named = []
        for i, (x, y) in enumerate(zip(a, b)):
            d, n = diff(x, y, ignore, names, f"{at}[{i}]")
            found.extend(d)
            named.extend(n)
        return found, named
    # JSON text: a float's repr round-trips, so equal text is equal bits (and 0.0 != -0.0, 1 != 1.0).
    return ([] if json.dumps(a) == json.dumps(b) else [{"field": at, "base": a, "current": b}]), []


def checks(base: dict, cur: dict) -> dict:
    """{check name: {"status": equal|differs|error, ...}}: HLO per path and stage (and its header), train per run."""
    pairs = {}
    for name in base:
        a, b = base[name], cur[name]
        if name.startswith("hlo/"):
            for stage in ["header", *STRATEGIES]:
                pairs[f"{name}/{stage}"] = (a, b, lambda d, s=stage: hlo_stage(d, s), HLO_IGNORE, HLO_NAMES)
        else:
            pairs[name] = (a, b, lambda d: d, TRAIN_IGNORE, set())
    result = {}
    for name, (a, b, pick, ignore, names) in pairs.items():
        errors = {f"{side}_error": d["error"] for side, d in (("base", a), ("current", b)) if "error" in d}
        if errors:
            result[name] = {"status": "error", "base": "" if "base_error" in errors else summary_line(name, pick(a))}
            result[name].update(errors)
            continue
        found, named = diff(pick(a), pick(b), ignore, names)
        result[name] = {"status": "differs" if found else "equal", "base": summary_line(name, pick(a))}
        if found:
            result[name].update(current=summary_line(name, pick(b)), n_differences=len(found))
            result[name]["differences"] = found[:MAX_DIFFS]
        if named:
            result[name].update(n_name_differences=len(named), name_differences=named[:MAX_DIFFS])
    return result


def hlo_stage(doc: dict, stage: str):
    """One strategy's part of a `jzero hlo --json` document, or its header (everything but the strategies)."""
    if stage == "header":
        return {k: v for k, v in doc.items() if k != "strategies"}
    return doc["strategies"].get(stage, "<absent>")


def summary_line(name: str, d) -> str:
    """A few of the compared numbers, for the table."""
    try:
        if name.startswith("train/"):
            s = d["summary"]
            return f"loss {s['loss_last']:.6f}  val {s['val_loss_last']:.6f}"
        if name.endswith("/header"):
            return f"{d['params'] / 1e9:.2f}B params, d={d['d']}, {d['target']} {d['topology']}"
        exposed = (d["schedule"].get("timing") or {}).get("exposed_s", float("nan"))
        return (
            f"DP {d['per_step']['dp_wire_bytes'] / 2**30:.2f} GiB/step, exposed {exposed * 1e3:.2f} ms, "
            f"temp {d['peak']['temp_bytes'] / 2**30:.2f} GiB"
        )
    except (KeyError, TypeError, AttributeError):
        return "?"


def table(result: dict) -> str:
    rows = [("check", "base", "result")]
    for name, r in result.items():
        status = r["status"]
        if status == "differs":
            fields = sorted({d["field"] for d in r["differences"]})
            status = f"DIFFERS ({r['n_differences']}): " + ", ".join(fields[:3]) + (" ..." if len(fields) > 3 else "")
        elif status == "error":
            side = "base" if "base_error" in r else "current"
            status = f"ERROR on {side}: " + r[f"{side}_error"].splitlines()[-1][:80]
        if r.get("n_name_differences"):
            status += f" (+{r['n_name_differences']} HLO names differ)"
        rows.append((name, r.get("base", ""), status))
    w = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:{w[0]}}  {b:{w[1]}}  {c}".rstrip() for a, b, c in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="commit to compare the working tree with, e.g. e3f7b9a")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "parity", help="where result.json goes")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` removes the worktree
    base_sha = sh("git", "rev-parse", "--verify", f"{args.base}^{{commit}}")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="jzero-parity-"))
    worktree = tmp / "base-tree"
    try:
        sh("git", "worktree", "add", "--detach", str(worktree), base_sha)
        print(f"base: {worktree} (jzero from {check_source(worktree)})", flush=True)
        sides = {"base": run_side(worktree, tmp / "base")}
        print(f"current: {ROOT} (jzero from {check_source(ROOT)})", flush=True)
        before = tree_state(ROOT)
        sides["current"] = run_side(ROOT, tmp / "current")
        after = tree_state(ROOT)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    result = checks(sides["base"], sides["current"])
    steady = before["source_sha256"] == after["source_sha256"]
    ok = steady and all(r["status"] == "equal" for r in result.values())
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "base": base_sha, "current": {"before": before, "after": after}, "current_steady": steady,
        "all_equal": ok, "elapsed_s": round(time.time() - t0, 1), "train_settings": TRAIN_SETTINGS,
        "ignored_fields": sorted(HLO_IGNORE | TRAIN_IGNORE), "hlo_name_fields": sorted(HLO_NAMES), "checks": result,
    }  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(doc, indent=1) + "\n")
    for path in PATHS:
        if "error" not in sides["base"][f"hlo/{path}"]:
            (args.out / f"base_hlo_{path}.json").write_text(json.dumps(sides["base"][f"hlo/{path}"], indent=1) + "\n")
    runs = {k.removeprefix("train/"): v for k, v in sides["base"].items() if k.startswith("train/")}
    metrics = {"commit": base_sha, "train_settings": TRAIN_SETTINGS, "runs": runs}
    (args.out / "base_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(table(result))
    if not steady:
        print("the working tree's jzero/ or configs/ changed while the current side ran: run again")
    print(f"{'ALL EQUAL' if ok else 'NOT EQUAL'}: base {base_sha[:10]} vs the working tree, {doc['elapsed_s']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
