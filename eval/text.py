"""Held-out text, tokenised once, cut into the fixed windows and prompts every runtime is given.

Every runtime under test receives exactly these token ids (never text), so no runtime's own
tokenizer or BOS policy can change what is compared. The ids come from the source model's HF
tokenizer (`AutoTokenizer` on the source directory), encoded without special tokens; BOS is then
placed explicitly:

- windows: consecutive, non-overlapping slices of the text, each `window` tokens long including a
  leading BOS (when the model has a BOS token, i.e. config.json or the tokenizer names one; pass
  `add_bos=False` to turn it off). At most `max_tokens` tokens in all (BOS included); the text
  beyond that is not used. A final window shorter than 2 tokens predicts nothing and is dropped.
  The context is reset at every window, so each window is scored independently.
- greedy prompts: the first `prompt_tokens` tokens of `prompts` windows spread evenly over the
  text; each runtime continues each prompt by `greedy_tokens` tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kiln.core.digest import sha256_json
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, SourceInvalid
from kiln.core.untrusted import loads_json

DEFAULT_WINDOW = 256
DEFAULT_MAX_TOKENS = 4096
DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_TOKENS = 32
DEFAULT_GREEDY_TOKENS = 32


@dataclass(frozen=True)
class EvalText:
    """The token ids an eval compares: windows to score and prompts to continue greedily."""

    windows: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...], ...]
    greedy_tokens: int
    vocab_size: int  # config.json vocab_size: logits are compared on these columns
    bos_token_id: int | None

    @property
    def tokens(self) -> int:
        """Scored positions: each window of n tokens predicts n - 1."""
        return sum(len(w) - 1 for w in self.windows)

    @property
    def context_needed(self) -> int:
        """The context length a runtime needs for the longest window or prompt + continuation."""
        longest_prompt = max((len(p) for p in self.prompts), default=0)
        return max(max((len(w) for w in self.windows), default=0), longest_prompt + self.greedy_tokens)

    @cached_property
    def digest(self) -> str:
        """sha256 over the canonical JSON of everything compared; recorded in the report."""
        return sha256_json(
            {
                "windows": [list(w) for w in self.windows],
                "prompts": [list(p) for p in self.prompts],
                "greedy_tokens": self.greedy_tokens,
                "vocab_size": self.vocab_size,
            }
        )

    def to_json(self) -> str:
        """The ids as JSON, so they are tokenised once and read back by every eval (`from_json`)."""
        return json.dumps(
            {
                "windows": [list(w) for w in self.windows],
                "prompts": [list(p) for p in self.prompts],
                "greedy_tokens": self.greedy_tokens,
                "vocab_size": self.vocab_size,
                "bos_token_id": self.bos_token_id,
                "digest": self.digest,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, data: str | bytes, *, digest: str) -> EvalText:
        """The `EvalText` `to_json` wrote, refused unless it is well formed and its digest is `digest`."""
        value = loads_json(data, what="eval text")
        try:
            text = cls(
                windows=tuple(_ids(w) for w in value["windows"]),
                prompts=tuple(_ids(p) for p in value["prompts"]),
                greedy_tokens=_int(value["greedy_tokens"]),
                vocab_size=_int(value["vocab_size"]),
                bos_token_id=None if value["bos_token_id"] is None else _int(value["bos_token_id"]),
            )
        except (KeyError, TypeError) as e:
            raise InvalidInput(f"stored eval text is malformed: {e!r}", code=Codes.EVAL_TEXT_INVALID) from None
        if text.digest != digest or value.get("digest") != digest:
            raise InvalidInput(
                f"stored eval text has digest {text.digest}, expected {digest}",
                code=Codes.EVAL_TEXT_INVALID,
                details={"digest": text.digest, "expected": digest},
            )
        return text


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value


def _ids(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise TypeError(f"expected a list of token ids, got {type(values).__name__}")
    return tuple(_int(v) for v in values)


def load_text(
    model_dir: str | Path,
    text_path: str | Path,
    **kwargs: Any,
) -> EvalText:
    """`tokenize_text` on the UTF-8 file `text_path` (the model's held-out text)."""
    path = Path(text_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"held-out text {str(path)!r} does not exist", details={"path": str(path)}) from None
    except UnicodeDecodeError as e:
        raise InvalidInput(f"held-out text {str(path)!r} is not UTF-8 ({e})", details={"path": str(path)}) from None
    return tokenize_text(model_dir, text, **kwargs)


def tokenize_text(
    model_dir: str | Path,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompts: int = DEFAULT_PROMPTS,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
    add_bos: bool | None = None,
) -> EvalText:
    """Tokenise `text` once with the tokenizer in `model_dir` and cut it into windows and prompts.

    `add_bos=None` prepends BOS when the model has one; True requires one; False never adds it.
    """
    if window < 2:
        raise InvalidInput(f"window must be at least 2 tokens, got {window}")
    if max_tokens < 2:
        raise InvalidInput(f"max_tokens must be at least 2, got {max_tokens}")
    if prompts < 0 or greedy_tokens < 0 or prompt_tokens < 1:
        raise InvalidInput("prompts and greedy_tokens must be >= 0 and prompt_tokens >= 1")
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    vocab_size = int(config["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    bos = config.get("bos_token_id")
    if bos is None:
        bos = tokenizer.bos_token_id
    if add_bos is True and bos is None:
        raise InvalidInput("add_bos=True but the model has no BOS token (config.json and tokenizer name none)")
    use_bos = bos is not None and add_bos is not False

    # verbose=False: the text is longer than model_max_length on purpose; windows keep within it.
    ids: list[int] = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if ids and max(ids) >= vocab_size:
        raise SourceInvalid(f"tokenizer produced id {max(ids)} >= config.json vocab_size {vocab_size}")
    head = [int(bos)] if use_bos else []
    step = window - len(head)
    budget = max_tokens
    windows: list[tuple[int, ...]] = []
    for start in range(0, len(ids), step):
        if budget < 2:
            break
        w = (*head, *ids[start : start + min(step, budget - len(head))])
        if len(w) < 2:
            break
        windows.append(w)
        budget -= len(w)
    if not windows:
        raise InvalidInput(f"held-out text gives {len(ids)} token(s); at least one window of 2 tokens is needed")

    eligible = [w for w in windows if len(w) >= prompt_tokens]
    chosen: list[tuple[int, ...]] = []
    if prompts and eligible:
        n = min(prompts, len(eligible))
        picks = sorted({round(i * (len(eligible) - 1) / max(n - 1, 1)) for i in range(n)})
        chosen = [eligible[i][:prompt_tokens] for i in picks]
    return EvalText(
        windows=tuple(windows),
        prompts=tuple(chosen) if greedy_tokens else (),
        greedy_tokens=greedy_tokens if chosen else 0,
        vocab_size=vocab_size,
        bos_token_id=int(bos) if use_bos else None,
    )
