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
(`COMPUTE_DTYPES`). The dtype is part of the report's runtime version. An int8 W8A8 bundle on a CPU whose
int8 GEMM clips its sums (`capabilities.Int8MatmulVerdict`: no VNNI) is not evaluated here: its figures
would be that kernel's, and they change with how oneDNN blocks the work (a build under Ray and a local
build published different results).

What this vLLM cannot run on this CPU is data (`CPU_LIMITS`), checked against this machine's verdict
(`eval.runtimes.capabilities`: decided from the CPU's flags and the installed libraries, planned into the
eval stage's key) and the kernels the worker reports: such a bundle is *not evaluated here*, with the
reason. A bundle vLLM refuses for any other reason fails the eval stage: transformers accepted it, so
that is a bug to find.

On a GPU (the eval stage placed on `cuda`, `pipeline.placement`) the same worker runs in vLLM's CUDA build
(`vllm-cuda`, `kiln runtime install vllm` on a GPU machine) with bf16 activations, as vLLM serves there, and
tensor parallelism over the GPUs the stage was granted (`cuda`: every GPU it sees, under Ray those of its
`num_gpus`, `pipeline.requirements` sizing that count from the weights; `cuda:N`: that one), the largest
power of two of them that divides the attention heads (`tensor_parallel_size`). The CPU's verdicts
(AMX, FP8 and int8 kernels) do not apply there; the GPU, the degree and the environment are in the
report's runtime version. What vLLM's CUDA build runs on which GPU generation is data too (`CUDA_KERNELS`,
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from core.device import Device, parse_device, resolve_device, visible_gpus
from core.errors import Deferred, InvalidInput, StageFailed
from eval.runtimes import environments
from eval.runtimes.base import check_ids
from eval.runtimes.capabilities import AMX_ENV, VllmCapabilities, vllm_capabilities
from eval.runtimes.vllm_worker import PROTOCOL

WORKER = Path(__file__).with_name("vllm_worker.py")
FULL_VOCAB_LIMIT = 32_768
TOP_K = 256
# The threads vLLM computes with (the eval stage's `cpus`, pipeline.requirements): a reduction
# over another thread count gives other last bits, so it is fixed, not the machine's core count.
DEFAULT_THREADS = 2
KV_CACHE_BYTES = 256 * 1024 * 1024  # vLLM on CPU reserves this for the KV cache (enough for the eval windows)


@dataclass(frozen=True)
class WeightScheme:
    """What a compressed-tensors config group says of the weights and activations of its layers."""

    weight_type: str  # "int" or "float" (FP8 only at 8 bits: an FP4 group is float at 4)
    weight_bits: int
    weight_strategy: str  # "tensor", "channel", "group", "block"
    activations: bool  # activations quantized too (W8A8) or not (weight-only)
    group_size: int | None = None  # elements per scale of a group strategy (NVFP4: 16, MXFP4: 32)

    @classmethod
    def from_group(cls, group: Any) -> WeightScheme:
        weights = group.get("weights") if isinstance(group, dict) else None
        bits = weights.get("num_bits") if isinstance(weights, dict) else None
        if not isinstance(weights, dict) or not isinstance(bits, int) or isinstance(bits, bool):
            raise InvalidInput(
                "a compressed-tensors config group needs `weights` with an integer `num_bits`",
                code="BUNDLE_CONFIG_INVALID",
            )
        size = weights.get("group_size")
        return cls(
            weight_type=str(weights.get("type")),
            weight_bits=bits,
            weight_strategy=str(weights.get("strategy")),
            activations=bool(group.get("input_activations")),
            group_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
        )


def int8_w8a8(scheme: WeightScheme) -> bool:
    """Int8 weights and int8 activations: what vLLM's CPU build runs through its int8 GEMM."""
    return scheme.weight_type == "int" and scheme.weight_bits == 8 and scheme.activations


@dataclass(frozen=True)
class Limitation:
    """A scheme vLLM's CPU backend runs only with a capability (`kernel:<op>` in its build, `amx` usable
    here, `fp8_matmul`: torch's FP8 matmul usable here, `int8_exact`: an int8 GEMM that sums in int32
    here), or never (`never`); `reason` is what the eval
    records when it is missing."""

    scheme: str
    matches: Callable[[WeightScheme], bool]
    needs: str
    reason: str


# Sources: vllm 0.32.0 model_executor/kernels/linear/__init__.py (init_nvfp4_linear_kernel, init_mxfp4_linear_kernel:
# no CPU entry), model_executor/kernels/linear/mixed_precision/cpu.py (CPUWNA16: uint4/uint4b8 only,
# through torch.ops._C.cpu_gemm_wna16) and kernels/linear/scaled_mm/cpu.py (block FP8: AMX kernels only);
# each reason was seen as vLLM's own load error on this machine kind (AMD EPYC, AVX2).
CPU_LIMITS: tuple[Limitation, ...] = (
    Limitation(
        "FP4",
        lambda s: s.weight_type == "float" and s.weight_bits == 4,
        "never",
        "vLLM has no CPU kernel for NVFP4 or MXFP4 (its load fails: 'Failed to find a kernel that can implement "
        "the NVFP4 linear layer', 'Marlin FP4 not available'); they run on NVIDIA sm80+ (Marlin FP4, natively on "
        "Blackwell) and AMD gfx950: deferred to such a runner",
    ),
    Limitation(
        "W4A16",
        lambda s: s.weight_type == "int" and s.weight_bits == 4 and not s.activations,
        "kernel:cpu_gemm_wna16",
        "this vLLM build has no cpu_gemm_wna16 kernel, which it runs 4-bit weight-only layers with on CPU",
    ),
    Limitation(
        "int8 W8A16",
        lambda s: s.weight_type == "int" and s.weight_bits == 8 and not s.activations,
        "never",
        "vLLM's CPU weight-only kernel (CPUWNA16) takes 4-bit weights only; int8 weight-only has no CPU kernel",
    ),
    Limitation(
        "FP8 W8A8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy != "block" and s.activations,
        "fp8_matmul",
        "vLLM runs per-channel FP8 W8A8 on CPU through torch._scaled_mm, which has no usable FP8 matmul here",
    ),
    Limitation(
        "int8 W8A8",
        int8_w8a8,
        "int8_exact",
        "vLLM runs int8 W8A8 on this CPU through oneDNN's int8 GEMM, which adds u8 x s8 product pairs in "
        "saturating 16-bit integers without VNNI: its figures would be the kernel's clipping, not the bundle's",
    ),
    Limitation(
        "block FP8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy == "block",
        "amx",
        "vLLM runs block-scaled FP8 on CPU with AMX kernels only (CPUFp8BlockScaledMMKernel)",
    ),
)


# The activation dtype vLLM computes a bundle in: float32, as transformers evaluates every bundle (the two
# runtimes then differ by their kernels, not by their arithmetic), except where vLLM's CPU kernel takes no
# float32: its 4-bit weight-only GEMM (seen here: `"cpu_gemm_wna16" not implemented for 'Float'`), with
# AMX in use its int8 W8A8 GEMM (`int8_scaled_mm_with_quant: expect A to be bfloat16 or half`), and its
# block FP8 GEMM, AMX only (`fp8_scaled_mm_cpu: expect A to be bfloat16 or half`).
# (name, which schemes, dtype, only where AMX is used)
DEFAULT_DTYPE = "float32"
COMPUTE_DTYPES: tuple[tuple[str, Callable[[WeightScheme], bool], str, bool], ...] = (
    ("W4A16", lambda s: s.weight_type == "int" and s.weight_bits == 4 and not s.activations, "bfloat16", False),
    ("int8 W8A8 with AMX", int8_w8a8, "bfloat16", True),
    (
        "block FP8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy == "block",
        "bfloat16",
        False,
    ),
)


# What vLLM's CUDA build runs on a GPU of compute capability `sm` (major × 10 + minor), read at the source
# of the pinned vllm 0.32.0 (the same Python in its CPU build): model_executor/layers/quantization/
# compressed_tensors/compressed_tensors.py `_get_scheme_from_parts` and each scheme's `get_min_capability`,
# utils/marlin_utils_fp8.py and marlin_utils_fp4.py (Marlin from sm75), utils/nvfp4_utils.py
# (`cutlass_fp4_supported`: sm100+), kernels/linear/mxfp4/flashinfer.py (sm100+), and
# v1/attention/backends/triton_attn.py (an FP8 KV cache needs SM89's fp8e4nv).
# kiln loads every bundle with bfloat16 activations, which need sm80 (Ampere): that is the floor.
BF16_MIN_SM = 80


@dataclass(frozen=True)
class CudaKernels:
    """How vLLM's CUDA build runs a scheme: with its own arithmetic from `native_sm`, and below that, from
    `loads_sm`, through a `fallback` kernel that computes something else (weight-only: activations stay
    bfloat16), which the eval then measures and names in its runtime version (`fallback`: a short label in
    the registry's runtime-version characters); below `loads_sm` it cannot run at all."""

    scheme: str
    matches: Callable[[WeightScheme], bool]
    native_sm: int
    loads_sm: int
    fallback: str = ""


def _fp4(s: WeightScheme) -> bool:
    return s.weight_type == "float" and s.weight_bits == 4


CUDA_KERNELS: tuple[CudaKernels, ...] = (
    CudaKernels(
        "NVFP4 W4A4",
        lambda s: _fp4(s) and s.group_size == 16 and s.activations,
        native_sm=100,
        loads_sm=75,
        fallback="NVFP4 weight-only (Marlin FP4 W4A16, below sm100)",
    ),
    CudaKernels("NVFP4 W4A16", lambda s: _fp4(s) and s.group_size == 16 and not s.activations, 75, 75),
    CudaKernels(
        "MXFP4",
        lambda s: _fp4(s) and s.group_size != 16,
        native_sm=100,
        loads_sm=80,
        fallback="MXFP4 weight-only (Marlin FP4 W4A16, below sm100)",
    ),
    CudaKernels(
        "FP8 W8A8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.activations,
        native_sm=89,
        loads_sm=75,
        fallback="FP8 weight-only (Marlin W8A16, below sm89)",
    ),
    CudaKernels("FP8 W8A16", lambda s: s.weight_type == "float" and s.weight_bits == 8 and not s.activations, 75, 75),
    CudaKernels("int8 W8A8", int8_w8a8, 75, 75),
    CudaKernels("int W4A16/W8A16", lambda s: s.weight_type == "int" and not s.activations, 75, 75),
)
FP8_KV_CACHE_MIN_SM = 89


@dataclass(frozen=True)
class CudaVerdict:
    """A bundle on a GPU: why vLLM cannot run it there (`cannot`), or what it runs instead of the bundle's
    own arithmetic (`fallbacks`, said in the eval's runtime version)."""

    cannot: str | None
    fallbacks: tuple[str, ...] = ()


def cuda_verdict(schemes: Sequence[WeightScheme], sm: int, fp8_kv_cache: bool = False) -> CudaVerdict:
    """What vLLM's CUDA build does with a bundle of `schemes` (and an FP8 KV cache) on a GPU of compute
    capability `sm` (`CUDA_KERNELS`); the smallest capability of the GPUs a tensor-parallel replica spans."""
    name = f"sm{sm}"
    if sm < BF16_MIN_SM:
        return CudaVerdict(f"kiln evaluates with bfloat16 activations, which need sm{BF16_MIN_SM}; this GPU is {name}")
    if fp8_kv_cache and sm < FP8_KV_CACHE_MIN_SM:
        return CudaVerdict(
            f"FP8 KV cache: vLLM's attention keeps an FP8 cache from sm{FP8_KV_CACHE_MIN_SM} (fp8e4nv); "
            f"this GPU is {name}"
        )
    fallbacks: list[str] = []
    for kernels in CUDA_KERNELS:
        if not any(kernels.matches(s) for s in schemes):
            continue
        if sm < kernels.loads_sm:
            return CudaVerdict(f"{kernels.scheme}: vLLM runs it from sm{kernels.loads_sm}; this GPU is {name}")
        if sm < kernels.native_sm and kernels.fallback not in fallbacks:
            fallbacks.append(kernels.fallback)
    return CudaVerdict(None, tuple(fallbacks))


def compute_dtype(schemes: Sequence[WeightScheme], amx: bool = False) -> str:
    """The activation dtype vLLM evaluates a bundle of `schemes` in (`COMPUTE_DTYPES`, else float32);
    `amx`: whether the worker lets vLLM use its AMX kernels."""
    for _, matches, dtype, needs_amx in COMPUTE_DTYPES:
        if (amx or not needs_amx) and any(matches(s) for s in schemes):
            return dtype
    return DEFAULT_DTYPE


def bundle_config(bundle_dir: Path) -> dict[str, Any]:
    """A bundle's config.json, as an object; anything else is a clear error, not a crash later."""
    try:
        config = json.loads((bundle_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(
            f"{bundle_dir}: no readable config.json ({e})",
            code="BUNDLE_CONFIG_INVALID",
            details={"path": str(bundle_dir)},
        ) from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{bundle_dir}: config.json is not an object", code="BUNDLE_CONFIG_INVALID")
    return config


def bundle_schemes(config: dict[str, Any]) -> list[WeightScheme]:
    """The weight schemes of a compressed-tensors bundle's config groups; [] for an unquantized one."""
    quant = config.get("quantization_config") or {}
    groups = quant.get("config_groups") if isinstance(quant, dict) else None
    if quant and not isinstance(groups, dict):
        raise InvalidInput("`quantization_config` has no `config_groups` object", code="BUNDLE_CONFIG_INVALID")
    return [WeightScheme.from_group(g) for g in (groups or {}).values()]


def fp8_kv_cache(config: dict[str, Any]) -> bool:
    """Whether a bundle's config asks for a quantized (FP8) KV cache: its `kv_cache_scheme`."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and bool(quant.get("kv_cache_scheme"))


def head_size(config: dict[str, Any]) -> int | None:
    """The model's attention head size from its config (None where it does not say it as integers)."""
    head, hidden, heads = config.get("head_dim"), config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(head, int) and head > 0:
        return head
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def cpu_limitation(
    schemes: Sequence[WeightScheme],
    capabilities: VllmCapabilities,
    hello: dict[str, Any],
    head: int | None = None,
    fp8_kv_cache: bool = False,
) -> str | None:
    """Why vLLM cannot run a bundle of `schemes` with attention heads of `head` (and an FP8 KV cache) here (given
    this machine's `capabilities` and the worker's `hello`), or None if it can."""
    sizes = hello.get("head_sizes")
    if head is not None and sizes and head not in sizes:
        return f"vLLM's CPU attention takes head sizes {', '.join(map(str, sizes))}; this model's is {head}"
    if fp8_kv_cache and "avx512f" not in capabilities.cpu_flags:
        # vllm 0.32.0 v1/attention/backends/cpu_attn.py: an fp8 cache only on x86 with AVX-512 (or AMX).
        return "FP8 KV cache: vLLM's CPU attention keeps an FP8 cache only with AVX-512; this CPU has none"
    for limit in CPU_LIMITS:
        if not any(limit.matches(s) for s in schemes):
            continue
        if limit.needs == "never":
            return f"{limit.scheme}: {limit.reason}"
        if limit.needs == "amx" and not capabilities.amx.used:
            return f"{limit.scheme}: {limit.reason}; AMX here: {capabilities.amx.reason}"
        if limit.needs == "fp8_matmul" and not capabilities.fp8_matmul.usable:
            return f"{limit.scheme}: {limit.reason} ({capabilities.fp8_matmul.reason})"
        if limit.needs == "int8_exact" and not capabilities.int8_matmul.exact:
            return f"{limit.scheme}: {limit.reason}"
        kernel = limit.needs.removeprefix("kernel:")
        if limit.needs.startswith("kernel:") and not hello["kernels"].get(kernel, False):
            return f"{limit.scheme}: {limit.reason}"
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
                code="EVAL_RUNTIME_PROTOCOL",
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
                code="EVAL_RUNTIME_DIED",
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
        code="EVAL_CAPABILITY_MISMATCH",
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
            raise StageFailed("the vLLM worker's reply was cut short", code="EVAL_RUNTIME_DIED")
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


def tensor_parallel_size(gpus: int, heads: int) -> int:
    """The degree vLLM shards a model over: the largest power of two up to `gpus` that divides `heads`."""
    size = 1
    while size * 2 <= gpus and heads % (size * 2) == 0:
        size *= 2
    return size


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
        why = cpu_limitation(schemes, here, hello, head_size(config), fp8_kv_cache=fp8_kv_cache(config))
        if why is not None:
            raise Deferred(
                f"vLLM {hello['vllm']} on this CPU cannot run it: {why}",
                details={"runtime_needed": "vllm"},
            )
        try:
            loaded, _ = self._worker.request(
                {
                    "op": "load",
                    "model": str(self.path),
                    "max_model_len": max_model_len + 1,  # a window's last row is one sampled token's
                    "kv_cache_bytes": KV_CACHE_BYTES,
                    "full_vocab_limit": FULL_VOCAB_LIMIT,
                    "top_k": TOP_K,
                    "dtype": compute_dtype(schemes, here.amx.used),
                }
            )
        except WorkerError as e:
            raise StageFailed(
                f"vLLM {hello['vllm']} could not load {str(self.path)!r}, which transformers loads: {e}",
                code="EVAL_RUNTIME_LOAD_FAILED",
                details={"runtime": self.name, "path": str(self.path), "error": e.kind},
            ) from None
        self.vocab_size = int(loaded["vocab"])
        self.load_seconds = float(loaded["load_s"])
        exact = hello.get("prompt_logprobs") == "engine arrays" or self.vocab_size <= FULL_VOCAB_LIMIT
        self.dtype = compute_dtype(schemes, here.amx.used)
        self.version = (
            f"vLLM {hello['vllm']} ({hello['build']}, a community CPU build), torch {hello['torch']}, "
            f"{self.dtype} activations, {threads} threads"
        ) + ("" if exact else f", top-{TOP_K} log-probabilities, the rest spread evenly")
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
        tp = tensor_parallel_size(len(granted), int(config.get("num_attention_heads", 1)))
        gpus = tuple(granted[:tp])
        self._worker = shared_worker(installed.python, threads, None, gpus)
        hello = self._worker.hello
        sm = hello.get("cuda_sm")
        if not isinstance(sm, int):
            raise StageFailed(
                f"vLLM {hello['vllm']} sees no CUDA GPU among {','.join(gpus)} (is its environment a CPU build?)",
                code="EVAL_RUNTIME_LOAD_FAILED",
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
                code="EVAL_RUNTIME_LOAD_FAILED",
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
            raise StageFailed("the vLLM runtime was closed", code="EVAL_RUNTIME_CLOSED")
        try:
            return self._worker.request(req)
        except WorkerError as e:
            raise StageFailed(
                f"vLLM failed on {req['op']!r} for {str(self.path)!r}: {e}",
                code="EVAL_RUNTIME_FAILED",
                details={"runtime": self.name, "error": e.kind},
            ) from None

    def close(self) -> None:
        if self.loaded:
            self.loaded = False
            self._worker.request({"op": "unload"})
