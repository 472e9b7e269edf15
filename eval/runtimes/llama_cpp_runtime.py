"""llama.cpp through llama-cpp-python: the runtime of the gguf target.

The model is opened with `logits_all=True`, so `Llama.eval` keeps the logits of every position
in `Llama.scores`. Token ids go in through `Llama.eval`, which never adds BOS (only
`Llama.tokenize` would), so llama.cpp sees exactly the ids the reference sees. Before every window
and every prompt the context is reset and its KV cache cleared, so windows are independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed
from kiln.eval.runtimes.base import check_ids, import_runtime


class LlamaCppRuntime:
    """A GGUF file loaded by llama.cpp on CPU.

    `vocab_size` (the model's config vocab) limits greedy argmax to real tokens when the GGUF's
    vocab is padded; logits are returned with all of llama.cpp's columns and compared on the
    common vocab by `eval.metrics`.
    """

    name = "llama.cpp"

    def __init__(
        self,
        gguf_path: str | Path,
        n_ctx: int = 512,
        *,
        n_threads: int = 2,
        n_batch: int = 512,
        vocab_size: int | None = None,
    ) -> None:
        (llama_cpp,) = import_runtime(("llama_cpp",), "llama.cpp")
        self._lib: Any = llama_cpp
        if n_ctx < 2:
            raise InvalidInput(f"n_ctx must be at least 2, got {n_ctx}")
        self.path = Path(gguf_path)
        if not self.path.is_file():
            raise InvalidInput(f"GGUF file {str(self.path)!r} does not exist", details={"path": str(self.path)})
        try:
            self._llm: Any = llama_cpp.Llama(
                model_path=str(self.path),
                n_ctx=n_ctx,
                n_batch=min(n_batch, n_ctx),
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=True,
                seed=0,
                verbose=False,
            )
        except (ValueError, RuntimeError) as e:
            raise StageFailed(
                f"llama.cpp could not load {str(self.path)!r}: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.path)},
            ) from None
        # `Llama.scores` has n_ctx rows as requested, whatever context llama.cpp itself rounded to.
        self.n_ctx = min(n_ctx, int(self._llm.n_ctx()))
        self.n_vocab = int(self._llm.n_vocab())
        self.vocab_size = min(vocab_size, self.n_vocab) if vocab_size is not None else self.n_vocab
        self.version = f"llama-cpp-python {llama_cpp.__version__}"

    def _reset(self) -> None:
        # `reset` only rewinds the token counter; clear the KV cache too, so nothing of the previous
        # window can leak into this one whatever `eval` does with stale cells.
        self._llm.reset()
        memory = self._lib.llama_get_memory(self._llm.ctx)
        if memory is not None:
            self._lib.llama_memory_clear(memory, True)

    def _fits(self, needed: int) -> None:
        if needed > self.n_ctx:
            raise InvalidInput(
                f"{needed} tokens do not fit llama.cpp's context of {self.n_ctx}; open the runtime with a larger n_ctx",
                details={"needed": needed, "n_ctx": self.n_ctx},
            )

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = check_ids(token_ids, self.n_vocab, self.name)
        self._fits(len(ids))
        self._reset()
        self._llm.eval(ids)
        return np.array(self._llm.scores[: len(ids)], dtype=np.float32, copy=True)

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return [self._greedy_one(p, n) for p in prompts]

    def _greedy_one(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        ids = check_ids(prompt_ids, self.n_vocab, self.name)
        self._fits(len(ids) + max(n - 1, 0))
        self._reset()
        self._llm.eval(ids)
        generated: list[int] = []
        for i in range(n):
            row = self._llm.scores[self._llm.n_tokens - 1, : self.vocab_size]
            tok = int(np.argmax(row))
            generated.append(tok)
            if i + 1 < n:
                self._llm.eval([tok])
        return generated

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()
