"""A refactor's proof: the example's artifacts built by two commits are the same bytes, artifact by artifact.

    python bench/artifact_digests.py --revs BEFORE [AFTER]      # build both (git worktrees, empty work dirs)
    python bench/artifact_digests.py --builds BEFORE.json AFTER.json   # two `kiln build --json` outputs

Each build runs `kiln build examples/tiny-llama/kiln.yaml --json` with its commit's code first on the path (the
same virtual environment). Per artifact it digests every file (sha256 over the sorted relative paths and
each file's sha256) and compares the two builds; it also compares the evals' status and KL. Prints a table of
the artifacts that differ, appears or vanish, and appends a record to bench/results/artifact_digests.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "examples/tiny-llama/kiln.yaml"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def artifact_digest(path: Path) -> str:
    """sha256 over (relative path, sha256) of every file under `path` (or of the one file it is)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for p in files:
        rel = p.relative_to(path).as_posix() if path.is_dir() else p.name
        h.update(f"{rel}\0{file_digest(p)}\n".encode())
    return h.hexdigest()


def digests(build: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per artifact of a `kiln build --json` report: its digest, eval status and mean KL."""
    return {
        a["artifact"]: {
            "digest": artifact_digest(Path(a["path"])),
            "eval": a["eval"],
            "kl": (a.get("metrics") or {}).get("kl"),
        }
        for a in build["artifacts"]
    }


def build_at(rev: str, tmp: Path) -> dict[str, Any]:
    """`kiln build` of the example with `rev`'s code (a detached worktree) into an empty work dir."""
    tree = tmp / f"tree-{rev}"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT, check=True)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, "-m", "kiln", "build", RECIPE, "--work-dir", str(tmp / f"work-{rev}"), "--json"]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"kiln build at {rev} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        report: dict[str, Any] = json.loads(proc.stdout)
        report["digests"] = digests(report)  # before the work dir goes
        return report
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--revs", nargs="+", metavar="REV", help="BEFORE [AFTER, default HEAD]")
    group.add_argument("--builds", nargs=2, type=Path, metavar="JSON", help="two `kiln build --json` outputs")
    ap.add_argument("--labels", nargs=2, metavar="NAME", help="with --builds: the two builds' commits, for the record")
    add_record_argument(ap, "artifact_digests")
    args = ap.parse_args()

    if args.builds:
        labels = args.labels or [str(p) for p in args.builds]
        found = [digests(json.loads(p.read_text())) for p in args.builds]
    else:
        revs = [*args.revs, "HEAD"][:2]
        labels = [
            subprocess.run(["git", "rev-parse", "--short", r], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            for r in revs
        ]
        with tempfile.TemporaryDirectory(prefix="kiln-bench-digests-") as tmp:
            found = [build_at(rev, Path(tmp))["digests"] for rev in labels]
    before, after = found
    names = sorted(set(before) | set(after))
    changed = [n for n in names if n in before and n in after and before[n] != after[n]]
    only = {
        label: sorted(set(d) - set(other))
        for label, d, other in ((labels[0], before, after), (labels[1], after, before))
    }
    print(f"{'artifact':>34} {'before':>14} {'after':>14} {'eval / KL':>28}")
    for n in changed:
        b, a = before[n], after[n]
        print(f"{n:>34} {b['digest'][:12]:>14} {a['digest'][:12]:>14} {b['eval']}/{b['kl']} -> {a['eval']}/{a['kl']}")
    same = sum(1 for n in names if n in before and n in after and before[n] == after[n])
    print(
        f"{same} of {len(names)} artifacts identical (files, eval status and KL); {len(changed)} differ; "
        f"only in one build: {only}"
    )
    save_record(
        run_record(
            before=labels[0],
            after=labels[1],
            identical=same,
            artifacts=len(names),
            differ=changed,
            only_in=only,
            digests={n: after.get(n, before.get(n, {})).get("digest") for n in names},
        ),
        args.record,
    )


if __name__ == "__main__":
    main()
