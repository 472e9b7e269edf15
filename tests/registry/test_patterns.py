"""Model name patterns compared as sets of names: containment and overlap, checked against brute force.

Patterns are drawn from a few letters and every fnmatch construct (`*`, `?`, `[...]`, `[!...]`,
ranges, unclosed brackets); names from one representative of each kind of model-name character those
patterns can tell apart (`-` and `_` sit at range ends, `.` between them, `b` after the letters used).
"""

from __future__ import annotations

import fnmatch
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.registry.auth.patterns import (
    MODEL_NAME_ALPHABET,
    name_outside,
    pattern_contains,
    patterns_overlap,
    shared_name,
)

PATTERN_CHARS = "a-*?[]!"
NAME_CHARS = "-._ab"
MAX_LENGTH = 5
NAMES = ["".join(t) for n in range(MAX_LENGTH + 1) for t in itertools.product(NAME_CHARS, repeat=n)]

patterns = st.text(alphabet=PATTERN_CHARS, max_size=6)


def _matches(pattern: str) -> set[str]:
    return {name for name in NAMES if fnmatch.fnmatchcase(name, pattern)}


@settings(max_examples=300, deadline=None)
@given(outer=patterns, inner=patterns)
def test_containment_agrees_with_brute_force(outer: str, inner: str) -> None:
    escaping = sorted(_matches(inner) - _matches(outer), key=lambda n: (len(n), n))
    witness = name_outside(outer, inner)
    assert pattern_contains(outer, inner) is (witness is None)
    if escaping:  # a name inner matches and outer does not: not contained, and the witness is as short
        assert witness is not None and len(witness) <= len(escaping[0])
    if witness is not None:  # the witness really is one (it may be longer than the names enumerated)
        assert set(witness) <= set(MODEL_NAME_ALPHABET)
        assert fnmatch.fnmatchcase(witness, inner) and not fnmatch.fnmatchcase(witness, outer)


@settings(max_examples=300, deadline=None)
@given(first=patterns, second=patterns)
def test_overlap_agrees_with_brute_force(first: str, second: str) -> None:
    common = sorted(_matches(first) & _matches(second), key=lambda n: (len(n), n))
    example = shared_name(first, second)
    assert patterns_overlap(first, second) is (example is not None)
    if common:
        assert example is not None and len(example) <= len(common[0])
    if example is not None:
        assert fnmatch.fnmatchcase(example, first) and fnmatch.fnmatchcase(example, second)


@pytest.mark.parametrize(
    ("outer", "inner", "contained"),
    [
        ("tiny-*", "tiny-*", True),
        ("tiny-*", "tiny-a*", True),
        ("tiny-*", "tiny-llama", True),
        ("tiny-*", "tiny-[ab]?", True),
        ("tiny-*", "[t]iny-*", True),
        ("tiny-*", "*", False),
        ("tiny-*", "t*", False),
        ("tiny-*", "tiny*", False),
        ("tiny-*", "tiny-", True),  # `*` matches nothing too
        ("other-?", "other-a*", False),
        ("*", "anything-[!x]*", True),
        ("[!a]*", "b*", True),
        ("[!a]*", "*", False),
    ],
)
def test_the_issue_s_cases(outer: str, inner: str, contained: bool) -> None:
    assert pattern_contains(outer, inner) is contained


def test_a_pattern_built_to_blow_up_is_answered_quickly_on_the_safe_side() -> None:
    outer = "*a" + "?" * 60  # a subset automaton of 2^60 states
    assert pattern_contains(outer, "*") is False
    assert pattern_contains(outer, "*a" + "?" * 59 + "b") is False  # contained, but not provably in budget
    with pytest.raises(ValueError, match="too complex"):
        name_outside(outer, "*a" + "?" * 59 + "b")
    assert pattern_contains(outer, outer) is True
