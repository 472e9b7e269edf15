"""Fuzz kiln's parsers of untrusted input for a while, keeping every crashing input as a regression case.

    python tools/fuzz.py                         # every target, 120 s each
    python tools/fuzz.py --seconds 600 --target gguf_header --target recipe

The targets and their structure-aware strategies are tests/fuzz/harness.py's. A crash is any
exception other than the target's documented error, a run longer than --timeout seconds, or memory
exhaustion under --memory-gib. Each crashing input is written to tests/fuzz/corpus/<target>/<sha256>.bin
(at most --keep per distinct crash), where tests/fuzz/test_fuzz.py replays it on every test run.
Prints one line per target: examples run, distinct crashes, inputs written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # tests/conftest.py's setting

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.fuzz.harness import CORPUS, TARGETS, FuzzTarget, fuzz_model_dir  # noqa: E402

CHUNK = 200  # examples per hypothesis run; the time budget is checked between runs


class FuzzTimeout(Exception):
    pass


@dataclass
class Tally:
    examples: int = 0
    crashes: dict[str, int] = field(default_factory=dict)  # signature -> inputs that hit it
    written: list[Path] = field(default_factory=list)


def _signature(e: BaseException) -> str:
    """The exception type and the innermost frame of the project's code (not tests/): one per distinct crash."""
    ours = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if f.filename.startswith(str(ROOT)) and not f.filename.startswith(str(ROOT / "tests"))
    ]
    where = f"{Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno}" if ours else "?"
    return f"{type(e).__name__} at {where}"


def _alarm(signum: int, frame: object) -> None:
    raise FuzzTimeout("the example ran past the time limit")


def fuzz(target: FuzzTarget, seconds: float, timeout: int, keep: int, scratch_root: Path) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    out_dir = CORPUS / target.name
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(data: bytes) -> None:
        if time.monotonic() > deadline:
            return
        tally.examples += 1
        with tempfile.TemporaryDirectory(dir=scratch_root) as scratch:
            signal.alarm(timeout)
            try:
                target.run(data, Path(scratch))
            except Exception as e:  # MemoryError and FuzzTimeout included
                if target.expected(e):
                    return
                sig = _signature(e)
                tally.crashes[sig] = tally.crashes.get(sig, 0) + 1
                if tally.crashes[sig] <= keep:
                    path = out_dir / f"{hashlib.sha256(data).hexdigest()}.bin"
                    if not path.exists():
                        path.write_bytes(data)
                        tally.written.append(path)
                    print(f"  crash: {sig}: {str(e)[:150]!r}\n    kept as {path.relative_to(ROOT)}", flush=True)
            finally:
                signal.alarm(0)

    run = 0
    while time.monotonic() < deadline:
        run += 1
        test = settings(
            max_examples=CHUNK,
            database=None,
            deadline=None,
            phases=[Phase.generate],  # a crash is recorded, not raised, so there is nothing to shrink
            suppress_health_check=list(HealthCheck),
        )(given(data=target.strategy)(one))
        seed(int.from_bytes(os.urandom(8), "little") ^ run)(test)()
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120, help="per target")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: all")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one example may take")
    parser.add_argument("--memory-gib", type=float, default=8, help="address-space limit of this process")
    parser.add_argument("--keep", type=int, default=3, help="inputs kept per distinct crash")
    args = parser.parse_args()
    names = args.target or sorted(TARGETS)
    if "config" in names:
        fuzz_model_dir()  # torch and transformers, before the memory limit
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-fuzz-") as scratch_root:
        for name in names:
            print(f"{name}: fuzzing for {args.seconds:g} s", flush=True)
            results[name] = fuzz(TARGETS[name], args.seconds, args.timeout, args.keep, Path(scratch_root))
    print(f"\n{'target':<20} {'examples':>9} {'crashes':>8} {'kept':>5}")
    for name, t in results.items():
        print(f"{name:<20} {t.examples:>9} {len(t.crashes):>8} {len(t.written):>5}")
        for sig, n in t.crashes.items():
            print(f"    {n:>5} x {sig}")
    sys.exit(1 if any(t.crashes for t in results.values()) else 0)


if __name__ == "__main__":
    main()
