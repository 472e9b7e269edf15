"""Bounded, deterministic fuzzing of every parser of untrusted input, and the replay of every crash found.

A failure here means a parser let an exception other than its documented error escape (or, for
the recipe, accepted a path outside the recipe's directory). Longer runs: `python tools/fuzz.py`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.harness import CORPUS, GOOD_RECIPE, TARGETS, FuzzTarget, corpus, fuzz_model_dir

EXAMPLES = {"safetensors_header": 400, "gguf_header": 400, "recipe": 300, "config": 200}
FUZZ = dict(
    derandomize=True,  # the same examples on every run: a failure here is reproducible
    database=None,
    deadline=None,  # wall-clock limits belong to tools/fuzz.py, not to a test on a loaded 2-core machine
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check(target: FuzzTarget, data: bytes, scratch: Path) -> None:
    try:
        target.run(data, scratch)
    except Exception as e:
        if not target.expected(e):
            raise


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name: str, tmp_path: Path) -> None:
    target = TARGETS[name]
    if name == "config":
        fuzz_model_dir()  # made before hypothesis runs: it uses seeded randomness

    @settings(max_examples=EXAMPLES[name], **FUZZ)
    @given(data=target.strategy)
    def run(data: bytes) -> None:
        with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
            _check(target, data, Path(scratch))

    run()


@pytest.mark.parametrize(
    ("name", "path"),
    [(name, path) for name in sorted(TARGETS) for path in corpus(name)],
    ids=lambda v: getattr(v, "name", v),
)
def test_corpus_replays_cleanly(name: str, path: Path, tmp_path: Path) -> None:
    """Every crash tools/fuzz.py ever found stays fixed: its input gives the documented error or none."""
    _check(TARGETS[name], path.read_bytes(), tmp_path)


def test_the_corpus_has_a_directory_per_target() -> None:
    assert set(TARGETS) <= {p.name for p in CORPUS.iterdir() if p.is_dir()}


def test_every_target_accepts_the_valid_input_its_strategy_starts_from(tmp_path: Path) -> None:
    """Without mutations a target must succeed, so the fuzzing is not vacuously refusing everything."""
    import json

    from kiln.formats.gguf.constants import ValueType
    from tests.file_builders import gguf_bytes, safetensors_bytes, valid_safetensors_header

    header = valid_safetensors_header({"a": [2, 2], "b": [3]})
    valid = {
        "safetensors_header": safetensors_bytes(header, b"\0" * 28),
        "gguf_header": gguf_bytes([("general.name", ValueType.STRING, "x")], [("t", [4], 0, 0)], data=b"\0" * 16),
        "recipe": json.dumps(GOOD_RECIPE).encode(),
        "config": (fuzz_model_dir() / "config.json").read_bytes(),
    }
    assert set(valid) == set(TARGETS)
    for name, data in valid.items():
        scratch = tmp_path / name
        scratch.mkdir()
        TARGETS[name].run(data, scratch)
