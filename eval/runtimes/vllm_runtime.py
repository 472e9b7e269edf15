"""vLLM: the runtime of the hf-bundle, rocm-bundle and TensorRT-LLM FP8 checkpoints, as vLLM serves them.

vLLM runs in its own environment (`eval.runtimes.environments`, `kiln runtime install vllm`), in a
worker process (`eval.runtimes.vllm_worker`) driven over a pipe by a small versioned protocol. One
worker serves every bundle of a process in turn (a bundle is loaded, evaluated, unloaded), so vLLM is
imported once per build, not once per bundle.

What it returns is the same as every runtime's: for each window the next-token distribution at
every position, here as vLLM's log-probabilities over the whole vocabulary (log-softmax of the
logits, so every metric is unchanged), read from the arrays vLLM's engine computed. Where vLLM's
internals differ from the pinned release, the worker reads `RequestOutput.prompt_logprobs` instead: all
of the vocabulary up to `FULL_VOCAB_LIMIT` tokens, above it the top `TOP_K` per position with the
remaining probability spread evenly over the rest (an approximation the report's version string says).

Activations are float32, as transformers evaluates every bundle, so the two runtimes' figures differ by
their kernels, not by their arithmetic; W4A16 is bf16, the only float type vLLM's CPU kernel for it takes
(`eval.runtimes.vllm_support.COMPUTE_DTYPES`). The dtype is part of the report's runtime version. An
int8 W8A8 bundle on a CPU whose int8 GEMM clips its sums (`capabilities.Int8MatmulVerdict`: no VNNI) is
not evaluated here: its figures would be that kernel's, and they change with how oneDNN blocks the work
(a build under Ray and a local build published different results).

What this vLLM cannot run on this CPU is data (`vllm_support.CPU_LIMITS` for its Linear layers,
`vllm_support.CPU_EXPERTS_LIMITS` for a mixture's experts), checked against this machine's verdict
(`eval.runtimes.capabilities`: decided from the CPU's flags and the installed libraries, planned into the
eval stage's key) and the kernels the worker reports: such a bundle is *not evaluated here*, with the
reason. Where vLLM's CPU experts kernel computes something else than the bundle (int4 experts with int8
activations), the runtime version says so. A bundle vLLM refuses for any other reason fails the eval stage:
transformers accepted it, so that is a bug to find; the worker tears down what the failed load left, and
loads the next bundle.

On a GPU (the eval stage placed on `cuda`, `pipeline.placement`) the same worker runs in vLLM's CUDA build
(`vllm-cuda`, `kiln runtime install vllm` on a GPU machine) with bf16 activations, as vLLM serves there, and
tensor parallelism over the GPUs the stage was granted (`cuda`: every GPU it sees, under Ray those of its
`num_gpus`, `pipeline.requirements` sizing that count from the weights; `cuda:N`: that one), the largest
power of two of them the model's heads shard over (`tensor_parallel_size`, by `placement.model.tp_degrees`, the rule
the plan sizes replicas with). The CPU's verdicts
(AMX, FP8 and int8 kernels) do not apply there; the GPU, the degree and the environment are in the
report's runtime version. What vLLM's CUDA build runs on which GPU generation is data too (`vllm_support.CUDA_KERNELS`,
checked against the compute capability the worker reads): a bundle it cannot run there (an FP8 KV cache
below sm89, anything below bf16's sm80) is not evaluated, with the reason; one it runs through a stand-in
kernel (FP8 W8A8 below sm89 and NVFP4 W4A4 below sm100 run weight-only through Marlin) is evaluated, and
the runtime version names the stand-in.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from kiln.core.device import Device, parse_device, resolve_device, visible_gpus
from kiln.core.error_codes import Codes
from kiln.core.errors import Deferred, InvalidInput, KilnError, StageFailed
from kiln.core.shape import ShapeRecord
from kiln.eval.runtimes import environments
from kiln.eval.runtimes.base import check_ids
from kiln.eval.runtimes.capabilities import AMX_ENV, VllmCapabilities, vllm_capabilities
from kiln.eval.runtimes.vllm_support import (
    architecture_limitation,
    bundle_config,
    bundle_expert_schemes,
    bundle_experts,
    bundle_schemes,
    compute_dtype,
    cpu_limitation,
    cuda_verdict,
    experts_stand_ins,
    fp8_kv_cache,
    head_size,
    mla_cpu_limitation,
)
from kiln.eval.runtimes.vllm_worker import PROTOCOL
from kiln.formats.architectures.shape import ModelShape
from kiln.placement.model import NULL_BLOCKS, paged_kv_cache, tp_degrees, vllm_defaults

WORKER = Path(__file__).with_name("vllm_worker.py")
FULL_VOCAB_LIMIT = 32_768
TOP_K = 256
# The threads vLLM computes with (the eval stage's `cpus`, pipeline.requirements): a reduction
# over another thread count gives other last bits, so it is fixed, not the machine's core count.
DEFAULT_THREADS = 2
# vLLM on the CPU reserves what one sequence of the eval's length takes (`kv_cache_reservation`), and no less
# than this, so that greedy prompts run side by side in a small model's cache.
KV_CACHE_BYTES = 256 * 1024 * 1024
# vLLM's LLM class on the CPU schedules 4,096 tokens a step, one step at a time (engine/arg_utils.py): a sliding
# layer holds its window and these.
CPU_IN_FLIGHT_TOKENS = 4096


def kv_cache_reservation(shape: ShapeRecord | None, max_model_len: int, element_bytes: int) -> int:
    """The KV cache the CPU runtime asks vLLM for: a sequence of `max_model_len` tokens as vLLM pages it on the
    CPU (`placement.model.PagedKvCache`: pages of `element_bytes` elements, as `vllm_defaults` sizes them on a CPU
    without AMX; MLA's are smaller, so AMX's pages never outgrow the reservation) and the block vLLM keeps back
    (it refuses to start with less), and at least KV_CACHE_BYTES; KV_CACHE_BYTES where the shape is unknown."""
    if shape is None:
        return KV_CACHE_BYTES
    paged = paged_kv_cache(
        shape,
        block_size=vllm_defaults("cpu", 0.0, mla=shape.is_mla).block_size,
        in_flight_tokens=CPU_IN_FLIGHT_TOKENS,
        element_bytes=element_bytes,
    )
    return max(KV_CACHE_BYTES, paged.bytes(max_model_len) + NULL_BLOCKS * paged.block_bytes)


def _shape(config: dict[str, Any]) -> ShapeRecord | None:
    """The bundle's shape as kiln reads config.json; None where kiln cannot (vLLM's own load decides)."""
    try:
        return ModelShape.from_config(config).record()
    except KilnError:
        return None


class WorkerProcess:
    """One worker in vLLM's environment; requests are answered in order, a dead worker is an error."""

    def __init__(
        self, python: Path, threads: int = DEFAULT_THREADS, amx: bool | None = None, gpus: tuple[str, ...] = ()
    ) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-vllm-", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")}
        env.pop("PYTHONPATH", None)  # nothing of kiln's environment leaks into vLLM's
        env["OMP_NUM_THREADS"] = str(threads)  # vLLM computes with these, on any machine
        if amx is not None:  # decided by kiln (the planned verdict): the worker does not decide again
            env[AMX_ENV] = "on" if amx else "off"
        if gpus:  # vLLM's CUDA build on these GPUs; the CPU's AMX question does not arise
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env[AMX_ENV] = "off"
        self.threads = threads
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        self.hello = self.request({"op": "hello"})[0]
        if self.hello.get("protocol") != PROTOCOL:
            self.close()
            raise StageFailed(
                f"vLLM worker speaks protocol {self.hello.get('protocol')}, kiln speaks {PROTOCOL}",
                code=Codes.EVAL_RUNTIME_PROTOCOL,
            )

    def _log_tail(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-12:])

    def request(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Send one request; its reply header (failed requests raise) and payload."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(json.dumps(req).encode() + b"\n")
            stdin.flush()
            line = stdout.readline()
        except BrokenPipeError:
            line = b""
        if not line:
            code = self.proc.wait()
            raise StageFailed(
                f"the vLLM worker exited ({code}) during {req['op']!r}; "
                f"its log ({self.log.name}) ends:\n{self._log_tail()}",
                code=Codes.EVAL_RUNTIME_DIED,
                details={"runtime": "vllm", "exit": code, "log": self.log.name},
            )
        header: dict[str, Any] = json.loads(line)
        payload = _read_exactly(stdout, int(header.get("nbytes", 0)))
        if not header.get("ok"):
            raise WorkerError(str(header.get("error")), str(header.get("type")))
        return header, payload

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(StageFailed, WorkerError):  # it may be dying already
                self.request({"op": "close"})
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # a dead worker's pipe
                    stream.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def _mismatch(planned: VllmCapabilities, here: VllmCapabilities) -> StageFailed:
    """The eval was planned under one verdict and this machine decides another."""
    a, b = planned.model_dump(mode="json"), here.model_dump(mode="json")
    differ = sorted(k for k in a if a[k] != b[k])
    planned_facts = ", ".join(f"{k}={a[k]}" for k in differ)
    here_facts = ", ".join(f"{k}={b[k]}" for k in differ)
    return StageFailed(
        f"this eval was planned for a machine where vLLM's capabilities are {planned_facts}; here they are "
        f"{here_facts}: plan it on the kind of machine that runs it",
        code=Codes.EVAL_CAPABILITY_MISMATCH,
        details={"planned": {k: a[k] for k in differ}, "here": {k: b[k] for k in differ}},
    )


class WorkerError(Exception):
    """The worker answered a request with a failure (vLLM raised)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise StageFailed("the vLLM worker's reply was cut short", code=Codes.EVAL_RUNTIME_DIED)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


_WORKERS: dict[tuple[Path, int, bool | None, tuple[str, ...]], WorkerProcess] = {}


def shared_worker(
    python: Path, threads: int = DEFAULT_THREADS, amx: bool | None = None, gpus: tuple[str, ...] = ()
) -> WorkerProcess:
    """The process's worker for that environment, thread count, AMX verdict (None: the worker's own) and
    GPUs (none: the CPU), started on first use, stopped at exit."""
    key = (python, threads, amx, gpus)
    worker = _WORKERS.get(key)
    if worker is not None and worker.proc.poll() is not None:  # died (its error was raised): start another
        worker.close()
        worker = None
    if worker is None:
        worker = _WORKERS[key] = WorkerProcess(python, threads, amx, gpus)
    return worker


def cuda_version(
    hello: dict[str, Any], tp: int, gpu_names: Sequence[object], sm: int, fallbacks: Sequence[str] = ()
) -> str:
    """The eval's runtime version on GPUs: vLLM, torch, the activations, the degree, the GPUs (counted by
    name, so eight of one kind stay short) and each kernel that stands in for the bundle's own."""
    counts: dict[str, int] = {}
    for name in gpu_names:
        counts[str(name)] = counts.get(str(name), 0) + 1
    gpus = ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items()) or "GPU"
    return (
        f"vLLM {hello['vllm']} ({hello['build']}, CUDA), torch {hello['torch']}, bfloat16 activations, "
        f"tensor parallel {tp} on {gpus} (sm{sm})"
    ) + "".join(f", {fallback}" for fallback in fallbacks)


def tensor_parallel_size(gpus: int, shape: ShapeRecord | None) -> int:
    """The degree vLLM shards a model over: the largest power of two up to `gpus` that the attention heads
    divide over and the KV heads divide over or replicate evenly over (`placement.model.tp_degrees`)."""
    allowed, _ = tp_degrees(shape, max(gpus, 1))
    return max(allowed)


@atexit.register
def _stop_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()


class VllmRuntime:
    """A bundle directory loaded by `vllm.LLM` on CPU, in vLLM's own environment.

    `capabilities`: the verdict the eval was planned with (its stage key holds it); this machine must
    decide the same, or the eval fails with EVAL_CAPABILITY_MISMATCH rather than record another verdict
    under that key. None: this machine's verdict."""

    name = "vllm"

    def __init__(
        self,
        bundle_dir: str | Path,
        *,
        max_model_len: int = 1024,
        threads: int = DEFAULT_THREADS,
        capabilities: VllmCapabilities | None = None,
        device: str = "cpu",
    ) -> None:
        self.path = Path(bundle_dir)
        if not self.path.is_dir():
            raise InvalidInput(f"bundle {str(self.path)!r} is not a directory", details={"path": str(self.path)})
        why = architecture_limitation(bundle_config(self.path))
        if why is not None:
            raise Deferred(f"vLLM does not serve this model: {why}", details={"runtime_needed": "vllm"})
        placed = parse_device(device)
        if placed is None or placed.is_cuda:
            placed = resolve_device(placed)
        if placed.is_cuda:
            self._open_on_gpus(placed, max_model_len, threads)
            return
        here = vllm_capabilities()
        if capabilities is not None and capabilities != here:
            raise _mismatch(capabilities, here)
        installed = environments.find("vllm")
        if installed is None:
            raise Deferred(
                "vLLM's runtime environment is not installed here: `kiln runtime install vllm` installs it",
                details={"runtime_needed": "vllm"},
            )
        config = bundle_config(self.path)
        schemes = bundle_schemes(config)
        self._worker = shared_worker(installed.python, threads, here.amx.used)
        hello = self._worker.hello
        if bool(hello["amx"]["used"]) != here.amx.used:  # the worker's torch sees another CPU than cpuinfo
            raise _mismatch(here, here.model_copy(update={"amx": here.amx.model_copy(update=hello["amx"])}))
        experts = bundle_experts(config)
        expert_schemes = bundle_expert_schemes(config)
        why = mla_cpu_limitation(config) or cpu_limitation(
            schemes,
            here,
            hello,
            head_size(config),
            fp8_kv_cache=fp8_kv_cache(config),
            experts=experts,
            expert_schemes=expert_schemes,
        )
        if why is not None:
            raise Deferred(
                f"vLLM {hello['vllm']} on this CPU cannot run it: {why}",
                details={"runtime_needed": "vllm"},
            )
        dtype = compute_dtype([*schemes, *expert_schemes], here.amx.used)
        length = max_model_len + 1  # a window's last row is one sampled token's
        try:
            loaded, _ = self._worker.request(
                {
                    "op": "load",
                    "model": str(self.path),
                    "max_model_len": length,
                    "kv_cache_bytes": kv_cache_reservation(_shape(config), length, 4 if dtype == "float32" else 2),
                    "full_vocab_limit": FULL_VOCAB_LIMIT,
                    "top_k": TOP_K,
                    "dtype": dtype,
                }
            )
        except WorkerError as e:
            raise StageFailed(
                f"vLLM {hello['vllm']} could not load {str(self.path)!r}, which transformers loads: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.path), "error": e.kind},
            ) from None
        self.vocab_size = int(loaded["vocab"])
        self.load_seconds = float(loaded["load_s"])
        exact = hello.get("prompt_logprobs") == "engine arrays" or self.vocab_size <= FULL_VOCAB_LIMIT
        self.dtype = dtype
        stand_ins = experts_stand_ins(expert_schemes, hello) if experts is not None else ()
        self.version = (
            (
                f"vLLM {hello['vllm']} ({hello['build']}, a community CPU build), torch {hello['torch']}, "
                f"{self.dtype} activations, {threads} threads"
            )
            + "".join(f", {s}" for s in stand_ins)
            + ("" if exact else f", top-{TOP_K} log-probabilities, the rest spread evenly")
        )
        self.loaded = True

    def _open_on_gpus(self, device: Device, max_model_len: int, threads: int) -> None:
        env = environments.variant_for("vllm", "cuda")
        installed = environments.find(env.name)
        if installed is None:
            raise Deferred(
                f"vLLM's CUDA environment is not installed here: `kiln runtime install vllm --variant cuda` "
                f"installs {env.label}",
                details={"runtime_needed": env.name},
            )
        config = bundle_config(self.path)
        granted = visible_gpus(device)
        tp = tensor_parallel_size(len(granted), _shape(config))
        gpus = tuple(granted[:tp])
        self._worker = shared_worker(installed.python, threads, None, gpus)
        hello = self._worker.hello
        sm = hello.get("cuda_sm")
        if not isinstance(sm, int):
            raise StageFailed(
                f"vLLM {hello['vllm']} sees no CUDA GPU among {','.join(gpus)} (is its environment a CPU build?)",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "gpus": list(gpus)},
            )
        verdict = cuda_verdict(bundle_schemes(config), sm, fp8_kv_cache=fp8_kv_cache(config))
        if verdict.cannot is not None:
            raise Deferred(
                f"vLLM {hello['vllm']} on these GPUs (sm{sm}) cannot run it: {verdict.cannot}",
                details={"runtime_needed": env.name},
            )
        try:
            loaded, _ = self._worker.request(
                {
                    "op": "load",
                    "model": str(self.path),
                    "max_model_len": max_model_len + 1,
                    "full_vocab_limit": FULL_VOCAB_LIMIT,
                    "top_k": TOP_K,
                    "dtype": "bfloat16",
                    "tensor_parallel_size": tp,
                }
            )
        except WorkerError as e:
            raise StageFailed(
                f"vLLM {hello['vllm']} could not load {str(self.path)!r} on GPUs {','.join(gpus)}: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.path), "error": e.kind, "gpus": list(gpus)},
            ) from None
        self.vocab_size = int(loaded["vocab"])
        self.load_seconds = float(loaded["load_s"])
        self.dtype = "bfloat16"
        self.tensor_parallel = tp
        self.version = cuda_version(hello, tp, loaded.get("gpus", []), sm, verdict.fallbacks) + (
            ""
            if hello.get("prompt_logprobs") == "engine arrays" or self.vocab_size <= FULL_VOCAB_LIMIT
            else f", top-{TOP_K} log-probabilities, the rest spread evenly"
        )
        self.loaded = True

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = check_ids(token_ids, self.vocab_size, self.name)
        header, payload = self._call({"op": "logits", "ids": ids})
        return np.frombuffer(payload, dtype="<f4").reshape(header["shape"]).copy()

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        checked = [check_ids(p, self.vocab_size, self.name) for p in prompts]
        header, _ = self._call({"op": "greedy", "prompts": checked, "n": n})
        return [[int(t) for t in row] for row in header["tokens"]]

    def _call(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        if not self.loaded:
            raise StageFailed("the vLLM runtime was closed", code=Codes.EVAL_RUNTIME_CLOSED)
        try:
            return self._worker.request(req)
        except WorkerError as e:
            raise StageFailed(
                f"vLLM failed on {req['op']!r} for {str(self.path)!r}: {e}",
                code=Codes.EVAL_RUNTIME_FAILED,
                details={"runtime": self.name, "error": e.kind},
            ) from None

    def close(self) -> None:
        if self.loaded:
            self.loaded = False
            self._worker.request({"op": "unload"})
