"""tensorrt_llm's PyTorch backend on an NVIDIA GPU: the runtime of trtllm checkpoints, on a GPU runner.

`LLM(model=DIR)` loads the HF-format checkpoint kiln wrote (what `trtllm-serve DIR` serves). Logits at
every position of a window come from `SamplingParams(return_context_logits=True)`
(`RequestOutput.context_logits`, [len, vocab]); greedy continuations from `temperature=0.0` with EOS
ignored, all prompts in one `generate` call (the engine batches them, as it would requests). KV-cache
block reuse is off: with it, a prompt sharing a prefix with an earlier one returns context logits
for its uncached suffix only (NVIDIA/Model-Optimizer issue #1577), and logits move slightly between
identical runs (TensorRT-LLM issue #15503). Sources: tensorrt_llm/sampling_params.py,
tensorrt_llm/inputs/data.py (token-id prompts), docs features/additional-outputs.md.

This runs only where tensorrt_llm and an NVIDIA GPU are; elsewhere opening it raises `Deferred`, and
the eval is recorded as not evaluated here. It has not run on this project's machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import StageFailed
from kiln.eval.runtimes.base import check_ids, import_runtime

RUNNER = "a GPU runner: an NVIDIA GPU (sm80+) with tensorrt_llm installed"


class TensorRTLLMRuntime:
    """A trtllm checkpoint directory loaded by tensorrt_llm's `LLM` (PyTorch backend) on this machine's GPU."""

    name = "tensorrt_llm"

    def __init__(self, model_dir: str | Path, vocab_size: int | None = None) -> None:
        tensorrt_llm, llmapi = import_runtime(
            ("tensorrt_llm", "tensorrt_llm.llmapi"), "tensorrt_llm", f"it runs on {RUNNER}"
        )
        LLM, KvCacheConfig = tensorrt_llm.LLM, llmapi.KvCacheConfig  # noqa: N806 (the library's class names)
        self.model_dir = Path(model_dir)
        try:
            self._llm: Any = LLM(model=str(self.model_dir), kv_cache_config=KvCacheConfig(enable_block_reuse=False))
        except (OSError, ValueError, RuntimeError) as e:
            raise StageFailed(
                f"tensorrt_llm could not load {str(self.model_dir)!r}: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.model_dir)},
            ) from None
        self.vocab_size = vocab_size
        self.version = f"tensorrt_llm {tensorrt_llm.__version__}"

    def _vocab(self, logits: np.ndarray) -> int:
        return self.vocab_size or int(logits.shape[-1])

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        from tensorrt_llm import SamplingParams

        ids = [int(t) for t in token_ids]
        out = self._llm.generate([ids], SamplingParams(max_tokens=1, return_context_logits=True))[0]
        logits = out.context_logits
        if logits is None:
            raise StageFailed("tensorrt_llm returned no context logits", code=Codes.EVAL_RUNTIME_FAILED)
        array = np.asarray(logits.float().cpu().numpy(), dtype=np.float32)
        check_ids(ids, self._vocab(array), self.name)
        if array.shape[0] != len(ids):
            raise StageFailed(
                f"tensorrt_llm returned context logits for {array.shape[0]} of {len(ids)} positions",
                code=Codes.EVAL_RUNTIME_FAILED,
            )
        return array

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        from tensorrt_llm import SamplingParams

        if n <= 0:
            return [[] for _ in prompts]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outputs = self._llm.generate([[int(t) for t in p] for p in prompts], params)
        return [[int(t) for t in out.outputs[0].token_ids[:n]] for out in outputs]

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None and hasattr(llm, "shutdown"):
            llm.shutdown()
