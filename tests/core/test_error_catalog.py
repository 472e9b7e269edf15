"""The error catalog (`core.error_codes`) is the one list of codes: every code kiln raises is in it, every code in
it is raised, the API and the CLI answer each with the statuses it gives, and the docs print it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from kiln.core import errors
from kiln.core.error_codes import CATALOG, DOCS, Codes, Kind, markdown, with_table
from kiln.core.errors import KIND_CLASSES, InvalidInput, KilnError, NotFound

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "core",
    "client",
    "pipeline",
    "registry",
    "eval",
    "targets",
    "placement",
    "quant",
    "formats",
    "storage",
    "kiln",
)
CATALOG_FILE = "core/error_codes.py"

# Where a `code=` is not a name of the catalog, and why that is sound.
DYNAMIC_CODES = {
    ("client/__init__.py", "code"): "a registry's answer, kept as sent (`KilnError.received`)",
    ("registry/hf_compat/service.py", "code"): "HubError passes on its caller's Codes.* name",
    ("targets/lint/findings.py", "first.code"): "a lint code (targets.lint.CODES, docs/targets.md)",
    ("targets/trtllm/export.py", "code"): "`model_refusal`'s Codes.* name",
    ("core/datafile.py", "code"): "`parse_record`'s caller's Codes.* name (INVALID_INPUT by default)",
    ("formats/gguf/reader.py", "e.code"): "the code of the InvalidInput it adds the file name to",
    ("kiln/routing/gather.py", "exc.code"): "the code of the error it adds the pool to",
    ("registry/web/routes.py", "code"): "an error page's template argument, not an error",
}
# Where a string equal to a code is not one of kiln's codes.
FOREIGN_STRINGS = {
    "registry/oci/media_types.py": "the distribution spec's own error codes, which kiln's codes map to",
}


@cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the packages but the catalog, parsed, by path relative to the repository."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != CATALOG_FILE:
                found[rel] = ast.parse(path.read_text(encoding="utf-8"), rel)
    return found


def _named_codes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Codes":
            yield node.lineno, node.attr


def _docstrings(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, owners) and node.body and isinstance(node.body[0], ast.Expr)
    }


def test_every_code_raised_is_in_the_catalog() -> None:
    unlisted, literal, dynamic, stray = [], [], [], []
    for rel, tree in _modules().items():
        unlisted += [f"{rel}:{line} Codes.{name}" for line, name in _named_codes(tree) if name not in CATALOG]
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call):
                values = [k.value for k in node.keywords if k.arg == "code"]
            elif isinstance(node, ast.ClassDef):
                values = [
                    s.value
                    for s in node.body
                    if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in s.targets)
                ]
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    literal.append(f"{rel}:{value.lineno} code={value.value!r}")
                elif isinstance(value, ast.Constant) or ast.unparse(value).split(".")[0] == "Codes":
                    continue
                elif (rel, ast.unparse(value)) not in DYNAMIC_CODES:
                    dynamic.append(f"{rel}:{value.lineno} code={ast.unparse(value)}")
        if rel not in FOREIGN_STRINGS:
            docs = _docstrings(tree)
            stray += [
                f"{rel}:{node.lineno} {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in CATALOG and id(node) not in docs
            ]
    assert not unlisted, f"codes named but not in the catalog (core/error_codes.py): {unlisted}"
    assert not literal, f"codes given as strings: name them from the catalog (code=Codes.NAME): {literal}"
    assert not dynamic, f"codes computed where the test cannot follow: name them, or list the place here: {dynamic}"
    assert not stray, f"codes spelled as strings rather than Codes.NAME: {stray}"


def test_every_code_in_the_catalog_is_raised() -> None:
    named = {name for tree in _modules().values() for _, name in _named_codes(tree)}
    assert not sorted(set(CATALOG) - named), "codes in the catalog that nothing raises: delete them"


def _class_kinds() -> dict[str, Kind]:
    """The kind of every error class of the packages, by name, from the source (names that differ are dropped)."""
    bases: dict[str, set[tuple[str, ...]]] = {}
    for tree in _modules().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).add(tuple(ast.unparse(b).split(".")[-1] for b in node.bases))
    classes = vars(errors).items()
    known = {name: cls.kind for name, cls in classes if isinstance(cls, type) and issubclass(cls, KilnError)}

    def kind(name: str, seen: frozenset[str] = frozenset()) -> Kind | None:
        if name in known:
            return known[name]
        if name in seen or len(bases.get(name, ())) != 1:
            return None
        found = {kind(base, seen | {name}) for base in next(iter(bases[name]))} - {None}
        return found.pop() if len(found) == 1 else None

    return {name: k for name in bases if (k := kind(name)) is not None}


def test_every_raise_names_a_code_of_its_class_kind() -> None:
    """The kind fixes the statuses, so `NotFound(..., code=Codes.QUANT_SHAPE)` would answer another one than the
    catalog says; `KilnError` refuses it when raised, and this finds it before."""
    kinds, wrong = _class_kinds(), []
    for rel, tree in _modules().items():
        for cls_node in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
            scope = tree if cls_node is None else cls_node
            for node in ast.walk(scope):
                if not isinstance(node, ast.Call):
                    continue
                code = next((k.value for k in node.keywords if k.arg == "code"), None)
                if not (isinstance(code, ast.Attribute) and ast.unparse(code.value) == "Codes"):
                    continue
                func = ast.unparse(node.func)
                owner = cls_node.name if cls_node is not None and func == "super().__init__" else func
                kind = kinds.get(owner)
                if kind is not None and kind not in CATALOG[code.attr].kinds:
                    wrong.append(f"{rel}:{node.lineno} {owner}(code=Codes.{code.attr}) is {kind.name}")
    assert not wrong, sorted(set(wrong))


def test_the_api_and_the_cli_answer_each_code_with_the_catalog_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln import cli
    from kiln.registry.api.errors import _CODE_BY_HTTP_STATUS, error_response

    answered = {}
    for entry in CATALOG.values():
        for kind in entry.kinds:
            error = KIND_CLASSES[kind]("what went wrong", code=entry.code)

            def failing(*args: object, error: KilnError = error, **kwargs: object) -> None:
                raise error

            monkeypatch.setattr(cli, "app", failing)
            with pytest.raises(SystemExit) as exited:
                cli.main()
            answered[entry.code, kind] = (error_response(error).status_code, exited.value.code)
    assert answered == {
        (e.code, kind): (e.http_status(kind), e.exit_status(kind)) for e in CATALOG.values() for kind in e.kinds
    }
    assert {status: CATALOG[code].http_status() for status, code in _CODE_BY_HTTP_STATUS.items()} == {
        status: status for status in _CODE_BY_HTTP_STATUS
    }


def test_kiln_errors_carry_only_codes_of_the_catalog() -> None:
    with pytest.raises(ValueError, match="not in the catalog"):
        InvalidInput("x", code="NO_SUCH_CODE")
    with pytest.raises(ValueError, match="QUANT_SHAPE is for errors of kind INVALID, not NotFound"):
        NotFound("x", code=Codes.QUANT_SHAPE)
    with pytest.raises(ValueError, match="not in the catalog"):
        type("Unlisted", (InvalidInput,), {"code": "UNLISTED"})
    assert InvalidInput("x", code=Codes.QUANT_SHAPE).code == "QUANT_SHAPE"
    assert KilnError.received("from a newer registry", code="SOMETHING_NEW").code == "SOMETHING_NEW"


def test_every_code_is_its_own_name() -> None:
    assert all(getattr(Codes, code) == code == entry.code for code, entry in CATALOG.items())
    assert all(entry.meaning and "\n" not in entry.meaning and "|" not in entry.meaning for entry in CATALOG.values())


@pytest.mark.parametrize("view", sorted(DOCS))
def test_the_docs_print_the_catalog(view: str) -> None:
    text = (ROOT / DOCS[view]).read_text(encoding="utf-8")
    assert with_table(text, view) == text, f"{DOCS[view]} is stale: python -m kiln.core.error_codes --write-docs"
    assert markdown(view).count("\n| `") == len(CATALOG)
