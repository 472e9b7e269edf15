"""Model name patterns compared as the sets of names they match: containment and overlap, computed.

Tokens (`--models`), trusted keys and webhooks name models with `fnmatch` patterns: `*` (any run of
characters), `?` (one character), `[...]` (one character of a set, `[!...]` one outside it, with
ranges such as `a-z`; a `[` without its `]` is a literal), and literal characters. Whether one
pattern's names are all matched by another is an access decision (an admin limited to `tiny-*` may
grant `tiny-a*`, never `*`, `t*` or `tiny*`), so it is decided exactly, not by comparing strings.

How: a pattern is a small automaton over its positions; the search walks both patterns' automata
side by side, one model-name character at a time (characters no pattern tells apart are walked
once), breadth first, so the first name found is a shortest one. Names are taken to be any string
over the model-name alphabet (`MODEL_NAME_ALPHABET`): a superset of the valid names, so containment
is never claimed where a valid name escapes.

Cost: a pattern's own automaton may have exponentially many states (`*a??????????` remembers the last
ten characters). `check_pattern` refuses a pattern whose automaton has more than `MAX_PATTERN_STATES`,
so two accepted patterns are compared in at most `MAX_STATES` (its square) states, decided exactly; a
search that would visit more (a pattern stored before the bound) answers "not contained": the safe side
of an access check. Answers are kept per pair of patterns, so a listing asks each pair once per process.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import string
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

# The characters of a model name (core.manifest.MODEL_NAME_PATTERN).
MODEL_NAME_ALPHABET = string.ascii_lowercase + string.digits + "._-"
MAX_PATTERN_STATES = 64  # `llama-3-*-instruct` has 19, `*a?????` 64, `*a??????????0000` 6,144
MAX_STATES = MAX_PATTERN_STATES**2
_SYNTAX = re.compile(r"^[a-z0-9*?\[\]._-]{1,64}$")

_ANY = "any"  # `?`
_STAR = "star"  # `*`


@dataclass(frozen=True)
class _Atom:
    kind: str  # "any", "star" or "set"
    chars: frozenset[str] = frozenset()  # for "set": the characters (of the alphabet) it matches


def _atoms(pattern: str, alphabet: str) -> tuple[_Atom, ...]:
    """`pattern` as a sequence of atoms, split the way `fnmatch.translate` splits it."""
    atoms: list[_Atom] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not atoms or atoms[-1].kind != _STAR:
                atoms.append(_Atom(_STAR))
        elif c == "?":
            atoms.append(_Atom(_ANY))
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal "["
                atoms.append(_Atom("set", frozenset(ch for ch in alphabet if ch == "[")))
            else:
                # The set's members are whatever fnmatch itself matches with the bracket expression.
                bracket = pattern[i - 1 : j + 1]
                atoms.append(_Atom("set", frozenset(ch for ch in alphabet if fnmatch.fnmatchcase(ch, bracket))))
                i = j + 1
        else:
            atoms.append(_Atom("set", frozenset(ch for ch in alphabet if ch == c)))
    return tuple(atoms)


def _closure(atoms: tuple[_Atom, ...], states: set[int]) -> frozenset[int]:
    """Positions reachable without reading a character (a `*` may match nothing)."""
    todo = list(states)
    seen = set(states)
    while todo:
        i = todo.pop()
        if i < len(atoms) and atoms[i].kind == _STAR and i + 1 not in seen:
            seen.add(i + 1)
            todo.append(i + 1)
    return frozenset(seen)


def _step(atoms: tuple[_Atom, ...], states: frozenset[int], ch: str) -> frozenset[int]:
    after: set[int] = set()
    for i in states:
        if i == len(atoms):
            continue
        atom = atoms[i]
        if atom.kind == _STAR:
            after.add(i)
        elif atom.kind == _ANY or ch in atom.chars:
            after.add(i + 1)
    return _closure(atoms, after)


def _letters(*patterns: tuple[_Atom, ...], alphabet: str) -> list[str]:
    """One character of each kind the patterns tell apart (the others lead to the same states)."""
    kinds: dict[tuple[bool, ...], str] = {}
    for ch in alphabet:
        kinds.setdefault(tuple(ch in atom.chars for atoms in patterns for atom in atoms if atom.kind == "set"), ch)
    return list(kinds.values())


def pattern_states(pattern: str, limit: int = MAX_PATTERN_STATES, alphabet: str = MODEL_NAME_ALPHABET) -> int:
    """The states of `pattern`'s automaton over `alphabet` (what comparing it costs), counted up to `limit + 1`."""
    atoms = _atoms(pattern, alphabet)
    letters = _letters(atoms, alphabet=alphabet)
    start = _closure(atoms, {0})
    seen, todo = {start}, [start]
    while todo and len(seen) <= limit:
        state = todo.pop()
        for ch in letters:
            after = _step(atoms, state, ch)
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return min(len(seen), limit + 1)


def check_pattern(pattern: str) -> None:
    """Refuse a model name pattern that is malformed (INVALID_PATTERN) or too costly to compare
    (PATTERN_TOO_COMPLEX: more than `MAX_PATTERN_STATES` states)."""
    if not _SYNTAX.fullmatch(pattern):
        raise InvalidInput(
            f"a model pattern is 1 to 64 lowercase name characters with * ? [ ]; got {pattern[:80]!r}",
            code=Codes.INVALID_PATTERN,
            details={"pattern": pattern[:80]},
        )
    if pattern_states(pattern) > MAX_PATTERN_STATES:
        raise InvalidInput(
            f"model pattern {pattern!r} is too costly to compare with others (more than {MAX_PATTERN_STATES} "
            "states: fewer `?` or `[...]` after a `*`)",
            code=Codes.PATTERN_TOO_COMPLEX,
            details={"pattern": pattern, "max_states": MAX_PATTERN_STATES},
        )


class _TooComplex(Exception):
    pass


def _shortest_name(first: str, second: str, wanted: Callable[[bool, bool], bool], alphabet: str) -> str | None:
    """The shortest name over `alphabet` for which `wanted(first matches, second matches)`, or None."""
    a, b = _atoms(first, alphabet), _atoms(second, alphabet)
    letters = _letters(a, b, alphabet=alphabet)
    start = (_closure(a, {0}), _closure(b, {0}))
    parent: dict[tuple[frozenset[int], frozenset[int]], tuple[tuple[frozenset[int], frozenset[int]], str] | None]
    parent = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if wanted(len(a) in state[0], len(b) in state[1]):
            name: list[str] = []
            link = parent[state]
            while link is not None:
                state, ch = link
                name.append(ch)
                link = parent[state]
            return "".join(reversed(name))
        if not state[0]:  # `first` can match nothing from here on; every search wants it to match
            continue
        for ch in letters:
            after = (_step(a, state[0], ch), _step(b, state[1], ch))
            if after not in parent:
                if len(parent) >= MAX_STATES:
                    raise _TooComplex
                parent[after] = (state, ch)
                queue.append(after)
    return None


def name_outside(outer: str, inner: str, alphabet: str = MODEL_NAME_ALPHABET) -> str | None:
    """A shortest name that `inner` matches and `outer` does not, or None when `outer` contains `inner`.

    Raises ValueError when the patterns are too complex to compare within `MAX_STATES` states.
    """
    if outer == inner:
        return None
    try:
        return _shortest_name(inner, outer, lambda in_inner, in_outer: in_inner and not in_outer, alphabet)
    except _TooComplex:
        raise ValueError(f"patterns {outer!r} and {inner!r} are too complex to compare") from None


@functools.lru_cache(maxsize=8192)
def pattern_contains(outer: str, inner: str) -> bool:
    """True when every model name `inner` matches is also matched by `outer` (`tiny-*` contains
    `tiny-a*` and `tiny-[ab]`, not `*`, `t*` or `tiny*`). Too complex to decide: False."""
    try:
        return name_outside(outer, inner) is None
    except ValueError:
        return False


def shared_name(first: str, second: str, alphabet: str = MODEL_NAME_ALPHABET) -> str | None:
    """A shortest name both patterns match, or None when they have none in common.

    Raises ValueError when the patterns are too complex to compare within `MAX_STATES` states.
    """
    try:
        return _shortest_name(first, second, lambda in_first, in_second: in_first and in_second, alphabet)
    except _TooComplex:
        raise ValueError(f"patterns {first!r} and {second!r} are too complex to compare") from None


@functools.lru_cache(maxsize=8192)
def patterns_overlap(first: str, second: str) -> bool:
    """True when some model name matches both patterns. Too complex to decide: False (what a caller
    is shown is decided on the safe side too)."""
    try:
        return shared_name(first, second) is not None
    except ValueError:
        return False
