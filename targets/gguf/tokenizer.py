"""Tokenizer metadata for GGUF, so llama.cpp tokenizes exactly as the HF fast tokenizer does.

The reference is the tokenizer transformers builds from the source (`read_vocab`, AutoTokenizer), not
tokenizer.json alone: transformers may rebuild parts of it from the model type. Loading transformers
takes seconds, so `predict_vocab` reads the same metadata from the files in milliseconds; the exporter
writes with the prediction and corrects the header if the reference disagrees.

Supported: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) whose pre-tokenizer is one llama.cpp
implements (constants.PRE_TOKENIZERS). Anything else is refused with a clear error rather than written
with a guessed pre-tokenizer that would silently tokenize differently. Follows llama.cpp's
`convert_hf_to_gguf.py` (`get_vocab_base`, `_set_vocab_gpt2`) and gguf-py's `SpecialVocab`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.gguf.constants import PRE_TOKENIZERS, Keys, PreTokenizerSpec, TokenType, ValueType
from kiln.formats.gguf.writer import Metadata

SPECIAL_TOKEN_KINDS = ("bos", "eos", "unk", "pad")
_SPECIAL_KEYS = {"bos": Keys.BOS_ID, "eos": Keys.EOS_ID, "unk": Keys.UNK_ID, "pad": Keys.PAD_ID}


def _unsupported(message: str, **details: Any) -> InvalidInput:
    return InvalidInput(message, code=Codes.GGUF_TOKENIZER_UNSUPPORTED, details=details)


@dataclass(frozen=True)
class VocabMetadata:
    """Everything the GGUF file says about the tokenizer."""

    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    chat_template: str | None = None
    padded: int = 0  # [PAD{i}] entries added up to the model's vocab_size
    notes: list[str] = field(default_factory=list)

    def add_to(self, writer: Metadata) -> None:
        writer.add_string(Keys.TOKENIZER_MODEL, "gpt2")
        writer.add_string(Keys.TOKENIZER_PRE, self.pre)
        writer.add_array(Keys.TOKENS, self.tokens, ValueType.STRING)
        writer.add_array(Keys.TOKEN_TYPE, self.token_types, ValueType.INT32)
        if self.merges:
            writer.add_array(Keys.MERGES, self.merges, ValueType.STRING)
        for kind, tid in self.special_ids.items():
            writer.add_uint32(_SPECIAL_KEYS[kind], tid)
        writer.add_bool(Keys.ADD_BOS, self.add_bos)
        writer.add_bool(Keys.ADD_EOS, self.add_eos)
        if self.chat_template:
            writer.add_string(Keys.CHAT_TEMPLATE, self.chat_template)


def detect_pre_tokenizer(tok: dict[str, Any]) -> PreTokenizerSpec:
    """The llama.cpp pre-tokenizer that splits text exactly as tokenizer.json's pre_tokenizer does."""
    pre = tok.get("pre_tokenizer")
    regex: str | None
    byte_level: dict[str, Any]
    if isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        regex, byte_level = None, pre
    elif (
        isinstance(pre, dict)
        and pre.get("type") == "Sequence"
        and len(pre.get("pretokenizers") or []) == 2
        and pre["pretokenizers"][0].get("type") == "Split"
        and pre["pretokenizers"][1].get("type") == "ByteLevel"
        and not pre["pretokenizers"][1].get("use_regex", True)
    ):
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        if split.get("behavior") != "Isolated" or split.get("invert", False) or regex is None:
            raise _unsupported(
                f"tokenizer: pre_tokenizer Split(behavior={split.get('behavior')!r}, "
                f"invert={split.get('invert')!r}) has no llama.cpp equivalent",
                pre_tokenizer=pre,
            )
    else:
        raise _unsupported(
            "tokenizer: pre_tokenizer is not one llama.cpp implements (supported: ByteLevel with its "
            "GPT-2 regex, or Split(regex) + ByteLevel for the "
            + ", ".join(p.name for p in PRE_TOKENIZERS[1:])
            + " regexes); refusing to guess a pre-tokenizer that would tokenize differently",
            pre_tokenizer=pre,
        )
    if byte_level.get("add_prefix_space", False):
        raise _unsupported("tokenizer: ByteLevel add_prefix_space=true is not supported by llama.cpp's BPE")
    for spec in PRE_TOKENIZERS:
        if spec.hf_regex == regex:
            ignore = bool((tok.get("model") or {}).get("ignore_merges", False))
            if ignore != spec.ignore_merges:
                raise _unsupported(
                    f"tokenizer: model.ignore_merges={ignore} but llama.cpp's {spec.name!r} pre-tokenizer "
                    f"assumes {spec.ignore_merges}; the tokenizations would differ",
                )
            return spec
    raise _unsupported(
        f"tokenizer: pre-tokenizer regex {regex!r} matches none of llama.cpp's known pre-tokenizers "
        f"({', '.join(p.name for p in PRE_TOKENIZERS)}); refusing to guess",
        regex=regex,
    )


def _merges(model: dict[str, Any]) -> list[str]:
    merges = model.get("merges") or []
    if not isinstance(merges, list):
        raise _unsupported("tokenizer: model.merges must be a list")
    if merges and isinstance(merges[0], str):
        return [str(m) for m in merges]
    out = []
    for m in merges:
        if not (isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m)):
            raise _unsupported(f"tokenizer: merge {m!r} is neither 'a b' nor a pair of strings")
        # llama.cpp splits merges at the space: a space inside a part is written as U+0120 + ... like
        # gguf-py does (byte-level vocabularies never contain a raw space anyway)
        out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
    return out


def _effective_tokenizer(root: Path) -> tuple[Any, dict[str, Any]]:
    """The HF fast tokenizer as transformers builds it, and its effective tokenizer.json.

    transformers may rebuild parts of tokenizer.json from the model type (e.g. Qwen2Tokenizer sets the
    Qwen2 pre-tokenizer regex whatever the file says), so the file alone is not the reference.
    """
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the message
        raise _unsupported(f"transformers cannot load the tokenizer in the source: {e}") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise _unsupported(f"the tokenizer ({type(hf).__name__}) is not a fast (tokenizers) tokenizer")
    return hf, json.loads(backend.to_str())


def _adds_special(hf: Any) -> tuple[bool, bool]:
    """Whether the HF tokenizer puts BOS first / EOS last when asked to add special tokens (observed)."""
    plain = hf("a b", add_special_tokens=False)["input_ids"]
    full = hf("a b", add_special_tokens=True)["input_ids"]
    bos, eos = hf.bos_token_id, hf.eos_token_id
    for add_bos, add_eos in ((False, False), (True, False), (False, True), (True, True)):
        if full == [bos] * add_bos + plain + [eos] * add_eos:
            return add_bos, add_eos
    raise _unsupported(
        f"the HF tokenizer wraps {plain} as {full}; llama.cpp can only add its BOS ({bos}) and EOS ({eos})"
    )


@dataclass(frozen=True)
class _Specials:
    ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_vocab(root: Path, vocab_size: int, config: dict[str, Any]) -> VocabMetadata:
    """The source's tokenizer, as transformers loads it, as GGUF tokenizer metadata (the reference).

    `vocab_size` is the model's (config.json); ids the tokenizer does not use up to it become
    `[PAD{id}]` tokens of type UNUSED, as llama.cpp's converter writes them.
    """
    hf, tok = _effective_tokenizer(root)
    _check_library_additions(hf, tok, root, vocab_size)
    # the tokenizer's own special tokens first, then config.json's ids, as gguf-py's SpecialVocab does
    ids = {kind: getattr(hf, f"{kind}_token_id", None) for kind in SPECIAL_TOKEN_KINDS}
    add_bos, add_eos = _adds_special(hf)
    template = getattr(hf, "chat_template", None)
    specials = _Specials(
        _special_ids(ids, config, vocab_size), add_bos, add_eos, template if isinstance(template, str) else None
    )
    return _vocab(tok, specials, vocab_size)


def check_special_tokens(root: Path, vocab_size: int) -> None:
    """The tokenizer's check that needs only its files: GGUF_VOCAB_MISMATCH where transformers adds special tokens
    past the model's vocab (`_check_library_additions`). `kiln plan` calls it (the target's `check_source_fn`), so
    a build is refused before ingest; `read_vocab` runs the same check on the tokenizer it loads, in the stage."""
    hf, tok = _effective_tokenizer(root)
    _check_library_additions(hf, tok, root, vocab_size)


def _check_library_additions(hf: Any, tok: dict[str, Any], root: Path, vocab_size: int) -> None:
    """Refuse, naming transformers as the cause, tokens its tokenizer class added past the model's vocab.

    Some classes add default special tokens that tokenizer.json does not have: transformers'
    Qwen2Tokenizer defaults unk, eos and pad to '<|endoftext|>' and adds it when tokenizer_config.json
    names none, so a tokenizer.json that ends at id vocab_size - 1 gains id vocab_size.
    """
    own = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    in_file = set((own.get("model") or {}).get("vocab") or {}) | {
        a.get("content") for a in own.get("added_tokens") or [] if isinstance(a, dict)
    }
    for added in tok.get("added_tokens") or []:
        tid, content = added.get("id"), added.get("content")
        if not isinstance(tid, int) or tid < vocab_size or content in in_file:
            continue
        roles = [f"{kind}_token" for kind in SPECIAL_TOKEN_KINDS if getattr(hf, f"{kind}_token", None) == content]
        cls = type(hf).__name__
        raise InvalidInput(
            f"tokenizer has token id {tid} but config.json vocab_size is {vocab_size}; the embedding matrix has "
            f"no row for it. The token, {content!r}, is not in tokenizer.json: transformers' {cls} added it "
            f"(as the default {' / '.join(roles) or 'special token'}) because tokenizer_config.json does not name "
            f"{'these' if len(roles) > 1 else 'this'}. Set {', '.join(roles) or 'the special tokens'} in "
            "tokenizer_config.json to tokens that tokenizer.json has, or add the token to tokenizer.json and "
            "raise vocab_size (and the embeddings) to cover it.",
            code=Codes.GGUF_VOCAB_MISMATCH,
            details={"token": content, "id": tid, "tokenizer_class": cls, "roles": roles},
        )


def predict_vocab(root: Path, vocab_size: int, config: dict[str, Any]) -> VocabMetadata:
    """`read_vocab`'s result as predicted from tokenizer.json, tokenizer_config.json and config.json alone."""
    tok = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    cfg_path = root / "tokenizer_config.json"
    tok_config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    vocab: dict[str, int] = dict((tok.get("model") or {}).get("vocab") or {})
    vocab.update({a["content"]: int(a["id"]) for a in tok.get("added_tokens") or []})
    ids: dict[str, Any] = {}
    for kind in SPECIAL_TOKEN_KINDS:
        entry = tok_config.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        ids[kind] = vocab.get(content) if isinstance(content, str) else None
    first, last = _template_ends(tok.get("post_processor"), vocab)
    add_bos = tok_config.get("add_bos_token")
    add_eos = tok_config.get("add_eos_token")
    special_ids = _special_ids(ids, config, vocab_size)
    template = tok_config.get("chat_template")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    specials = _Specials(
        special_ids,
        add_bos if isinstance(add_bos, bool) else first is not None and first == special_ids.get("bos"),
        add_eos if isinstance(add_eos, bool) else last is not None and last == special_ids.get("eos"),
        template if isinstance(template, str) else None,
    )
    return _vocab(tok, specials, vocab_size)


def _template_ends(post: Any, vocab: dict[str, int]) -> tuple[int | None, int | None]:
    """The special token ids a TemplateProcessing post-processor puts first / last around one text."""
    if not isinstance(post, dict):
        return None, None
    procs = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            first = single[0].get("SpecialToken", {}).get("id") if single else None
            last = single[-1].get("SpecialToken", {}).get("id") if single else None
            return vocab.get(first) if first else None, vocab.get(last) if last else None
    return None, None


def _special_ids(ids: dict[str, Any], config: dict[str, Any], vocab_size: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in SPECIAL_TOKEN_KINDS:
        for cand in (ids.get(kind), config.get(f"{kind}_token_id")):
            if isinstance(cand, int) and not isinstance(cand, bool) and 0 <= cand < vocab_size:
                out[kind] = cand
                break
    return out


def _vocab(tok: dict[str, Any], specials: _Specials, vocab_size: int) -> VocabMetadata:
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise _unsupported(
            f"tokenizer: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')}) is not "
            "supported; GGUF export handles byte-level BPE tokenizers"
        )
    decoder = tok.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise _unsupported(f"tokenizer: decoder {decoder.get('type')!r} is not ByteLevel; not a byte-level BPE")
    notes: list[str] = []
    normalizer = tok.get("normalizer")
    if normalizer is not None:
        if normalizer.get("type") != "NFC":
            raise _unsupported(f"tokenizer: normalizer {normalizer.get('type')!r} is not supported by llama.cpp")
        notes.append("HF applies NFC normalization, llama.cpp does not: non-NFC input may tokenize differently")
    pre = detect_pre_tokenizer(tok)

    ids: dict[str, int] = dict(model.get("vocab") or {})
    added = {int(a["id"]): a for a in tok.get("added_tokens") or []}
    for tid, a in added.items():
        ids[a["content"]] = tid
    by_id: dict[int, str] = {}
    for text, tid in ids.items():
        if tid in by_id and by_id[tid] != text:
            raise _unsupported(f"tokenizer: id {tid} is used by both {by_id[tid]!r} and {text!r}")
        by_id[tid] = text
    if not by_id:
        raise _unsupported("tokenizer: the vocabulary is empty")
    top = max(by_id)
    if top >= vocab_size:
        raise InvalidInput(
            f"tokenizer has token id {top} but config.json vocab_size is {vocab_size}; "
            "the embedding matrix has no row for it",
            code=Codes.GGUF_VOCAB_MISMATCH,
        )
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return VocabMetadata(
        pre=pre.name,
        tokens=tokens,
        token_types=types,
        merges=_merges(model),
        special_ids=specials.ids,
        add_bos=specials.add_bos,
        add_eos=specials.add_eos,
        chat_template=specials.chat_template,
        padded=vocab_size - len(by_id),
        notes=notes,
    )
