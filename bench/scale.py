"""Benchmark: kiln's stages at real model scale, per stage: time, peak memory, bytes read and written.

    python bench/scale.py [--sizes 1b,8b] [--work DIR] [--targets gguf-f16,hf-bundle-fp8,...] [--split]
        [--keep] [--record FILE]

Writes Llama-shaped random-weight models once under --work (reused by later runs): `1b` has
Llama-3.2-1B's shape (hidden 2048, 16 layers, intermediate 8192, 32 heads, 8 KV heads of 64, tied
embeddings), `8b` Llama-3-8B's (hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 KV heads),
both with Llama-3's 128,256-token vocabulary: a byte-level BPE tokenizer of the example's kind
(GPT-2 pre-tokenizer, trained on the Python standard library) with 128,000 tokens and 256 special
tokens after them, as Llama-3 lays its out. Weights are bf16, N(0, 0.02) (norms 1), generated and
written one tensor at a time into ~5 GB SafeTensors shards with `model.safetensors.index.json`.

For each size it builds one recipe with `kiln build --json` (the local executor, in a fresh process,
into an empty work dir): GGUF F16 / Q8_0 / Q4_K_M, hf-bundle FP8 / INT8-W8A8 / INT4-RTN, orbax bf16 and
trtllm FP8, each evaluated by its runtimes on the recipe's default eval budget (4,096 scored tokens in
256-token windows, 4 greedy prompts of 32 tokens; `--small-eval`: 256 tokens, 128-token windows, 2 prompts of
8 tokens, for a smoke run). Each stage's provenance records what its run used
(`core.usage`), and the table shows it per stage: wall time; the process's peak RSS and peak anonymous
memory (RssAnon; RSS also counts memory-mapped file pages, which the kernel can reclaim); the peak of
its child processes (vLLM's worker); bytes read and written at the storage layer (`disk`) and through
read/write calls (`calls`; memory-mapped reads are in neither when the file is cached); and throughput,
the model's bf16 bytes over the stage's wall time.

The reference and each transformers eval hold the model as the plan decided for this machine's memory
(whole where it fits 80 % of it; `--host-memory GIB` plans for less, as `KILN_HOST_MEMORY` does, so they
stream by layer), and record their passes over the weights (`passes`). Each is then timed against its
ceiling, measured in the same run: a fresh process that loads the same model whole in float32
(`TransformersRuntime`) and does the same work (the reference's logits, rows and greedy continuation; the
eval against the stored reference). Target: each within 1.5x of its ceiling.

Targets (issue 24), checked in the table: at 8B, every stage without calibration that streams (not one the
plan had hold the model whole) peaks at <= 2 GiB + 2x the largest tensor (the embedding) + what its plan let
it keep resident, checked on the stage's anonymous peak plus its children's (and shown for RSS); the same
bound is shown at 1B. With `--sizes 1b,8b`, each stage's throughput at 8B is at least 0.67x its throughput
at 1B (cost linear in size).

The disk's own cold sequential read rate is measured in the same run, before each size builds (`measure_disk`:
a scratch file written, dropped from the page cache with posix_fadvise, read back once), and each stage's
storage reads over it give the seconds it spent reading the disk at least (`disk s`). Where a stage misses the
throughput target, the check says whether its time beside those reads meets it: a stage bound by re-reading
what no longer stays in the page cache at 8B.

Disk: the models and every artifact (ingest links the source; an 8B build of the whole recipe needs
~125 GB). The run prints what it needs against what is free, and refuses when it will not fit: pick
artifacts with --targets, or --split, which builds one artifact (with its quantize stage) at a time and
deletes it after reading its provenance, so the disk holds the source and the largest artifact. The work
dir is deleted after the run (not the models) unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from random_model import checkpoint_tensors, write_weights  # noqa: E402 (beside this script)
from record import add_record_argument, run_record, save_record  # noqa: E402 (bench/record.py, beside this script)

GIB = 1 << 30
MB = 1e6
VOCAB = 128_256  # Llama-3's
SPECIAL_TOKENS = 256  # Llama-3's: <|begin_of_text|>, <|end_of_text|>, reserved ... after the BPE tokens
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
EXIT_GATE_FAILED = 3  # kiln build: every stage ran, some artifact failed its eval gate
HEADROOM = 2 * GIB  # free disk kept beyond the estimate
MEMORY_BASE = 2 * GIB  # the memory target: this + 2x the largest tensor
THROUGHPUT_RATIO = 0.67
EVAL = {"max_tokens": 4096, "window": 256, "greedy_prompts": 4, "greedy_tokens": 32}  # the recipe's defaults
SMALL_EVAL = {"max_tokens": 256, "window": 128, "greedy_prompts": 2, "greedy_tokens": 8}  # --small-eval
CEILING_RATIO = 1.5  # the reference and each transformers eval, against the same work with the model whole
DISK_PROBE_BYTES = 2 * GIB  # the scratch file measure_disk reads back cold


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int
    rope_theta: float

    def config(self) -> dict[str, Any]:
        """config.json, with the keys transformers 5 writes for a Llama (as examples/tiny-llama's)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": VOCAB - SPECIAL_TOKENS,
            "dtype": "bfloat16",
            "eos_token_id": VOCAB - SPECIAL_TOKENS + 1,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": self.max_positions,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pad_token_id": VOCAB - SPECIAL_TOKENS + 1,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tied,
            "use_cache": True,
            "vocab_size": VOCAB,
        }

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor in checkpoint order (embeddings, layers in order, final norm, lm_head)."""
        return checkpoint_tensors(self.config())

    @property
    def model_bytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape in self.tensors())

    @property
    def largest_tensor_bytes(self) -> int:
        return max(2 * math.prod(shape) for _, shape in self.tensors())

    @property
    def memory_target(self) -> int:
        return MEMORY_BASE + 2 * self.largest_tensor_bytes


SIZES = {
    "1b": Size("1b", 2048, 16, 8192, 32, 8, 64, tied=True, max_positions=131072, rope_theta=500000.0),
    "8b": Size("8b", 4096, 32, 14336, 32, 8, 128, tied=False, max_positions=8192, rope_theta=500000.0),
}
# (target, quant) in recipe order: the artifacts of the realistic recipe.
ARTIFACTS = [
    ("gguf", "f16"),
    ("gguf", "q8_0"),
    ("gguf", "q4_k_m"),
    ("gguf", "mxfp4"),
    ("hf-bundle", "fp8"),
    ("hf-bundle", "int8-w8a8"),
    ("hf-bundle", "int4-rtn"),
    ("orbax", "bf16"),
    ("trtllm", "fp8"),
]
KEPT_STAGES = ("ingest", "reference", "prepare")  # what --split keeps between artifacts


# -- the tokenizer and the model ---------------------------------------------------------------------------


def make_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer of VOCAB tokens (tokenizer.json + tokenizer_config.json), written once."""
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    texts += [t.upper() for t in texts]  # the library alone has ~123k merges; its upper case has the rest
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    print(f"training a {VOCAB - SPECIAL_TOKENS}-token BPE on {len(files)} stdlib files ...", file=sys.stderr)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if tok.get_vocab_size() != VOCAB - SPECIAL_TOKENS:
        sys.exit(f"the standard library gave {tok.get_vocab_size()} BPE tokens, not {VOCAB - SPECIAL_TOKENS}")
    names = [BOS, EOS] + [f"<|reserved_special_token_{i}|>" for i in range(SPECIAL_TOKENS - 2)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if tok.get_vocab_size() != VOCAB or tok.token_to_id(BOS) != VOCAB - SPECIAL_TOKENS:
        sys.exit(f"tokenizer has {tok.get_vocab_size()} tokens, BOS at {tok.token_to_id(BOS)}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    fast.model_max_length = 8192
    fast.save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_model(out: Path, size: Size, tokenizer: Path, seed: int = 0) -> Path:
    """The random-weight release of `size` in `out`, written once: one tensor in memory at a time."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in tokenizer.iterdir():
        shutil.copyfile(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(size.config(), indent=2, sort_keys=True) + "\n")
    write_weights(tmp, size.config(), seed=seed, label=size.name)
    tmp.rename(out)
    return out


# -- disk ------------------------------------------------------------------------------------------------


def artifact_bytes(size: Size, target: str, quant: str) -> tuple[int, int, int]:
    """(quantize stage output, export output, transient during the export) in bytes, from the shape alone."""
    from kiln.formats.safetensors import DTYPES
    from kiln.quant.catalog import get_scheme
    from kiln.quant.footprint import checkpoint_bytes
    from kiln.quant.rtn import planned_tensors, quantizes

    tensors = size.tensors()
    matrices = sum(math.prod(s) for _, s in tensors if len(s) == 2)
    if target == "gguf":
        # The plan's own count of the file (`placement.weights.gguf_bytes`); a type llama.cpp's quantizer
        # makes (Q4_K_M) goes through a lossless (bf16) GGUF first, deleted after.
        from kiln.formats.architectures.shape import ModelShape
        from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS
        from kiln.placement.weights import gguf_bytes

        transient = 2 * matrices if GGUF_QUANTS[quant].llama_ftype is not None else 0
        return 0, gguf_bytes(ModelShape.from_config(size.config()), quant), transient
    if target == "orbax":
        return 0, size.model_bytes, 0
    scheme = get_scheme(quant)
    quantized = 0  # the quantize stage stores only the tensors the scheme replaces
    for name, shape in tensors:
        if quantizes(scheme, name):
            quantized += sum(DTYPES[d].itemsize * math.prod(s) for _, d, s in planned_tensors(scheme, name, shape))
    return quantized, checkpoint_bytes(size.config(), quant), 0


def disk_needed(size: Size, artifacts: list[tuple[str, str]], split: bool, have_model: bool) -> dict[str, int]:
    """Bytes the run needs on the work dir's disk: the model (unless generated already), the reference's rows,
    and the artifacts (all of them, or with `split` the largest group). Ingest links the source beside the
    work dir (the same filesystem), so it writes nothing."""
    groups = _groups(artifacts) if split else [artifacts]
    per_group = []
    for group in groups:
        parts = [artifact_bytes(size, t, q) for t, q in group]
        quantize = {q: p[0] for (_, q), p in zip(group, parts, strict=True)}  # shared per scheme
        per_group.append(sum(quantize.values()) + sum(p[1] for p in parts) + max((p[2] for p in parts), default=0))
    reference = max(EVAL["max_tokens"], SMALL_EVAL["max_tokens"]) * 4096 * 12 + (1 << 20)
    return {
        "model": 0 if have_model else size.model_bytes,
        "reference": reference,
        "artifacts": max(per_group) if split else sum(per_group),
    }


def _groups(artifacts: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The artifacts that share a quantize stage, together (hf-bundle and trtllm FP8): --split's units."""
    from kiln.targets.base import get_target

    groups: dict[str, list[tuple[str, str]]] = {}
    for target, quant in artifacts:
        shared = quant in get_target(target).quantized_input
        groups.setdefault(f"quantize/{quant}" if shared else f"{target}-{quant}", []).append((target, quant))
    return list(groups.values())


# -- the build ---------------------------------------------------------------------------------------------


def write_recipe(recipe_dir: Path, size: Size, artifacts: list[tuple[str, str]], budget: dict[str, int]) -> Path:
    targets: dict[str, list[str]] = {}
    for target, quant in artifacts:
        targets.setdefault(target, []).append(quant)
    shutil.copyfile(ROOT / "examples/tiny-llama/heldout.txt", recipe_dir / "heldout.txt")
    lines = [
        f"model: scale-{size.name}",
        "version: 1.0.0",
        f"description: random-weight Llama of the {size.name} shape (bench/scale.py)",
        "source: model",
        "eval:",
        "  text: heldout.txt",
        *(f"  {k}: {v}" for k, v in budget.items()),
        "targets:",
        *(f"  - target: {t}\n    quants: [{', '.join(qs)}]" for t, qs in targets.items()),
    ]
    path = recipe_dir / "kiln.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def kiln_env(host_memory: float | None) -> dict[str, str]:
    """The environment of kiln's processes: oneDNN held to AVX-512 BF16, and the host memory to plan for."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")}
    if host_memory is not None:
        env["KILN_HOST_MEMORY"] = str(int(host_memory * GIB))
    return env


def kiln_build(
    recipe: Path, work: Path, log: Path, device: str = "cpu", host_memory: float | None = None
) -> dict[str, Any]:
    """`kiln build RECIPE --json` in a fresh process; its summary. A failed gate is a result, not a failure."""
    cmd = [sys.executable, "-m", "kiln", "build", str(recipe), "--work-dir", str(work), "--json"]
    cmd += ["--device", device]
    env = kiln_env(host_memory)
    started = time.perf_counter()
    with open(log, "a") as err:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    if proc.returncode not in (0, EXIT_GATE_FAILED):
        tail = log.read_text(errors="replace").splitlines()[-40:]
        sys.exit(f"kiln build {recipe} failed ({proc.returncode}); {log} ends:\n" + "\n".join(tail))
    summary: dict[str, Any] = json.loads(proc.stdout)
    summary["process_s"] = round(time.perf_counter() - started, 1)
    return summary


def plan_rows(recipe: Path, work: Path, device: str = "cpu", host_memory: float | None = None) -> list[dict[str, Any]]:
    """The recipe's nodes in the order `kiln build` runs them, as `kiln plan --json` plans them (its disk and
    estimated seconds among them)."""
    cmd = [sys.executable, "-m", "kiln", "plan", str(recipe), "--work-dir", str(work), "--json", "--device", device]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=kiln_env(host_memory))
    if proc.returncode != 0:
        sys.exit(f"kiln plan {recipe} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows: list[dict[str, Any]] = json.loads(proc.stdout)
    return rows


def stage_rows(work: Path, size: Size, ran: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the provenance of each stage in `ran` (its plan rows, in the order they ran) says it used, beside
    the seconds its plan estimated."""
    found = {}
    for meta in work.glob("*/*/stage.json"):
        data = json.loads(meta.read_text())
        found[data["node"]] = {**data, "_path": meta}
    rows = []
    for planned in ran:
        node = planned["node"]
        if node not in found:
            continue  # a stage with effects outside the store: none in this recipe
        data = found[node]
        status = data["result"].get("status") if data.get("record") == "EvalReport" else None
        used = data["provenance"].get("resources")
        if used is None:
            sys.exit(f"{meta} has no resources in its provenance: this checkout's kiln does not record them")
        rows.append(
            {
                "node": data["node"],
                "size": size.name,
                "wall_s": used["wall_s"],
                "cpu_s": used["cpu_s"],
                "rss_start_bytes": used["rss_start_bytes"],
                "peak_rss_bytes": used["peak_rss_bytes"],
                "peak_rss_exact": used["peak_rss_exact"],
                "anon_start_bytes": used["anon_start_bytes"],
                "peak_anon_bytes": used["peak_anon_bytes"],
                "anon_end_bytes": used["anon_end_bytes"],
                "children_peak_rss_bytes": used["children_peak_rss_bytes"],
                "io": used["io"],
                "children_io": used["children_io"],
                "device": (data["provenance"].get("device") or {}).get("name"),
                "device_peak_bytes": used.get("device_peak_bytes"),
                "output_bytes": sum(f["size"] for f in data["files"]),
                # An eval recorded as not evaluated (its runtime is not here) did no work to time.
                "eval_status": status,
                "throughput_bps": (
                    size.model_bytes / used["wall_s"] if used["wall_s"] > 0 and status != "not_evaluated" else None
                ),
                "weights": used.get("weights"),  # how it held the model, and its passes over the weights
                "planned_s": planned.get("floor_seconds", planned.get("seconds")),  # the plan's floor
                "estimated_s": planned.get("seconds"),  # and its estimate (placement.cost), before the build ran
                "kind": planned.get("kind"),
                "stage_json": str(found[node]["_path"]),
            }
        )
    return rows


def holds_transformers(row: dict[str, Any]) -> bool:
    """A stage that computes in transformers: the reference, or an eval in transformers that evaluated."""
    weights = row.get("weights")
    return weights is not None and (row["node"].startswith("reference/") or row.get("eval_status") != "not_evaluated")


def whole_fits(size: Size) -> bool:
    """Whether the model whole in float32 (what the ceiling holds) fits this machine's memory budget (whatever
    `--host-memory` made the build plan for): where it does not (8B here: 32 GB), there is no whole-model time to
    compare with, only a process killed for its memory."""
    from kiln.core.device import host_memory_bytes
    from kiln.pipeline.requirements import HOLD_UTILIZATION

    memory = host_memory_bytes()
    return memory is not None and 2 * size.model_bytes <= HOLD_UTILIZATION * memory


def measure_ceiling(stage_json: Path, device: str, log: Path) -> dict[str, float]:
    """Wall and CPU seconds the stage's work takes with the model loaded whole, in a fresh process (`--ceiling`)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ceiling", str(stage_json), "--device", device]
    with open(log, "a") as err:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=kiln_env(None))
    if proc.returncode != 0:
        sys.exit(f"the ceiling of {stage_json} failed ({proc.returncode}); see {log}")
    timed: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return timed


def ceiling(stage_json: Path, device: str) -> dict[str, float]:
    """The work of the reference or transformers eval whose stage.json is `stage_json`, with the model loaded
    whole in float32 (`TransformersRuntime`): the same text, the same rows or the same comparison."""
    from kiln.eval.gates import Gate
    from kiln.eval.reference_rows import ReferenceStore, reference_rows
    from kiln.eval.run import evaluate_artifact
    from kiln.eval.runtimes.layer_stream import open_transformers
    from kiln.eval.runtimes.residency import WHOLE
    from kiln.eval.text import EvalText

    data = json.loads(stage_json.read_text())
    work = stage_json.parents[2]
    dirs = {}
    for meta in work.glob("*/*/stage.json"):
        dirs[json.loads(meta.read_text())["node"]] = meta.parent / "files"
    inputs = data["provenance"]["inputs"]
    if data["provenance"]["stage"] == "reference":
        files, result = stage_json.parent / "files", data["result"]
        text = EvalText.from_json((files / "eval_text.json").read_bytes(), digest=result["text_digest"])
        params = result["params"]
        started, cpu = time.perf_counter(), time.process_time()
        runtime = open_transformers(dirs[inputs["ingest"]["node"]], "float32", device, residency=WHOLE)
        for window, logits in zip(text.windows, runtime.logits_many(text.windows), strict=True):
            reference_rows(
                logits[:-1],
                window[1:],
                vocab_size=text.vocab_size,
                tail_mass=params["tail_mass"],
                max_entries=params["max_entries"],
            )
        runtime.greedy(text.prompts, text.greedy_tokens)
        runtime.close()
        return {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}
    ref_files = dirs[inputs["reference"]["node"]]
    ref = json.loads((ref_files.parent / "stage.json").read_text())["result"]
    reference = ReferenceStore(ref_files, identity=ref["source_digest"], name=ref["runtime"], version=ref["version"])
    text = EvalText.from_json((ref_files / "eval_text.json").read_bytes(), digest=ref["text_digest"])
    export = dirs[inputs["export"]["node"]]
    written = [f for f in export.rglob("*") if f.is_file()]
    artifact = written[0] if len(written) == 1 else export
    gate = Gate(**data["provenance"]["params"]["gate"])
    started, cpu = time.perf_counter(), time.process_time()
    evaluate_artifact(reference, "transformers", artifact, text, gate, device=device, residency=WHOLE)
    return {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def prune(work: Path) -> None:
    """Delete every stage output but the ones --split keeps (the source's ingested copy, the reference)."""
    for stage_dir in work.iterdir():
        if stage_dir.is_dir() and stage_dir.name not in KEPT_STAGES and any(stage_dir.glob("*/stage.json")):
            shutil.rmtree(stage_dir)


def measure_disk(work: Path, nbytes: int = DISK_PROBE_BYTES) -> dict[str, float]:
    """This disk's sequential read rate, cold: `nbytes` of random data written under `work` and synced, dropped
    from the page cache (posix_fadvise DONTNEED: clean pages of a file nothing maps), then read once in 8 MiB
    reads. What a stage gets that reads back what no longer stays in the page cache."""
    chunk = os.urandom(8 << 20)
    path = work / ".disk-probe"
    try:
        with open(path, "wb") as f:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            started, read = time.perf_counter(), 0
            while block := os.read(fd, len(chunk)):
                read += len(block)
            seconds = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"read_bytes": read, "seconds": round(seconds, 3), "read_bps": read / seconds}


def disk_seconds(row: dict[str, Any], disk: dict[str, float]) -> float:
    """The seconds `row`'s stage spent at least reading the disk: its storage reads (its own and its children's)
    at the disk's measured cold rate."""
    read = (row["io"] or {}).get("read_bytes", 0) + (row["children_io"] or {}).get("read_bytes", 0)
    return read / disk["read_bps"]


def run_size(size: Size, args: argparse.Namespace, artifacts: list[tuple[str, str]]) -> dict[str, Any]:
    recipe_dir = args.work / size.name
    recipe_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or make_tokenizer(args.work / "tokenizer-128256")
    model = make_model(recipe_dir / "model", size, tokenizer)
    disk = measure_disk(recipe_dir)
    print(f"  {size.name}: disk reads {disk['read_bps'] / MB:,.0f} MB/s cold", file=sys.stderr)
    work = recipe_dir / "work"
    shutil.rmtree(work, ignore_errors=True)  # every stage built in this run: its provenance is this run's
    (recipe_dir / "reports").mkdir(exist_ok=True)
    log = recipe_dir / "build.log"
    log.write_text("")
    rows: list[dict[str, Any]] = []
    summaries = []
    for group in _groups(artifacts) if args.split else [artifacts]:
        recipe = write_recipe(recipe_dir, size, group, args.budget)
        print(f"  {size.name}: kiln build {', '.join(f'{t}-{q}' for t, q in group)} ...", file=sys.stderr)
        summary = kiln_build(recipe, work, log, args.device, args.host_memory)
        summaries.append(
            {k: summary.get(k) for k in ("stages", "seconds", "process_s", "peak_rss_mib", "failed_gates")}
        )
        built = set(summary["stage_seconds"])  # the stages this build ran (not those a previous group built)
        planned = plan_rows(recipe, work, args.device, args.host_memory)
        group_rows = stage_rows(work, size, [r for r in planned if r["node"] in built])
        for row in group_rows:  # each against the same work with the model whole, before --split prunes it
            if holds_transformers(row) and whole_fits(size):
                print(f"  {size.name}: {row['node']} with the model whole ...", file=sys.stderr)
                timed = measure_ceiling(Path(row["stage_json"]), args.device, log)
                row["ceiling_s"], row["ceiling_cpu_s"] = round(timed["wall_s"], 3), round(timed["cpu_s"], 3)
        for row in group_rows:
            row["disk_s"] = round(disk_seconds(row, disk), 3)
        rows += group_rows
        if args.split:
            prune(work)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "size": size.name,
        "model_bytes": size.model_bytes,
        "largest_tensor_bytes": size.largest_tensor_bytes,
        "memory_target_bytes": size.memory_target,
        "shards": len(list(model.glob("*.safetensors"))),
        "disk": disk,
        "builds": summaries,
        "stages": rows,
    }


# -- the table ---------------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.0f}"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / MB:,.0f}"


def check_memory(row: dict[str, Any], target: int) -> dict[str, Any]:
    """The stage's held memory (its anonymous peak plus its children's) and its RSS against `target`; a stage the
    plan had hold the model whole (it fit this machine's budget) is not held to the streaming target."""
    held = (row["peak_anon_bytes"] or 0) + row["children_peak_rss_bytes"]
    rss = (row["peak_rss_bytes"] or 0) + row["children_peak_rss_bytes"]
    applies = _held(row) != "whole"
    target += (row.get("weights") or {}).get("resident_bytes", 0)  # what its plan let it keep besides a layer
    return {
        "held_bytes": held,
        "applies": applies,
        "held_ok": held <= target or not applies,
        "rss_ok": rss <= target or not applies,
        "over_bytes": held - target if applies else 0,
    }


HEAD: tuple[str, ...] = ("stage", "wall s", "RSS MiB", "anon MiB", "growth", "child MiB", "disk r/w MB")
HEAD += "calls r/w MB", "MB/s", "held", "RSS", "GPU MiB", "model", "passes", "whole s", "ratio"
FMT = "{:30} {:>6} {:>8} {:>8} {:>7} {:>9} {:>13} {:>15} {:>6} {:>5} {:>5} {:>8} {:>8} {:>6} {:>7} {:>10}"


def check_ceiling(row: dict[str, Any]) -> dict[str, Any] | None:
    """The stage's wall time over the same work with the model whole, against `CEILING_RATIO`."""
    if row.get("ceiling_s") is None:
        return None
    ratio = row["wall_s"] / row["ceiling_s"]
    cpu_ratio = row["cpu_s"] / row["ceiling_cpu_s"] if row.get("ceiling_cpu_s") else None
    return {
        "ratio": round(ratio, 3),
        "ok": ratio <= CEILING_RATIO,
        # CPU seconds: the same comparison, less moved by other work on a shared machine
        "cpu_ratio": None if cpu_ratio is None else round(cpu_ratio, 3),
    }


def _held(row: dict[str, Any]) -> str:
    weights = row.get("weights")
    if weights is None:
        return "-"
    return "whole" if weights["held"] == ["whole"] else "streamed"


def print_table(result: dict[str, Any]) -> None:
    target = result["memory_target_bytes"]
    print(
        f"\n{result['size']}: model {result['model_bytes'] / 1e9:.2f} GB bf16, largest tensor "
        f"{result['largest_tensor_bytes'] / (1 << 20):.0f} MiB; memory target {target / (1 << 20):,.0f} MiB "
        "(2 GiB + 2x the largest tensor; 'held' = anonymous peak + children's peak)"
    )
    print(FMT.format(*HEAD))
    for row in result["stages"]:
        io = row["io"] or {}
        mem = row["memory"]
        print(
            FMT.format(
                row["node"],
                f"{row['wall_s']:.1f}",
                _mib(row["peak_rss_bytes"]) + ("" if row["peak_rss_exact"] else "~"),
                _mib(row["peak_anon_bytes"]),
                _mib(row["peak_anon_bytes"] - row["anon_start_bytes"]) if row["anon_start_bytes"] is not None else "-",
                _mib(row["children_peak_rss_bytes"]) if row["children_peak_rss_bytes"] else "-",
                f"{_mb(io.get('read_bytes'))}/{_mb(io.get('write_bytes'))}",
                f"{_mb(io.get('rchar'))}/{_mb(io.get('wchar'))}",
                f"{row['throughput_bps'] / MB:,.0f}" if row["throughput_bps"] else _not_run(row),
                ("PASS" if mem["held_ok"] else "FAIL") if mem["applies"] else "-",
                ("PASS" if mem["rss_ok"] else "FAIL") if mem["applies"] else "-",
                _mib(row.get("device_peak_bytes")),
                _held(row),
                "-" if row.get("weights") is None else f"{row['weights']['passes']:.2f}",
                "-" if row.get("ceiling_s") is None else f"{row['ceiling_s']:.1f}",
                "-" if row.get("ceiling") is None else f"{row['ceiling']['ratio']:.2f} {_verdict(row['ceiling'])}",
            )
        )
    print(
        "growth: anonymous peak over the stage's start (what it allocated itself); ~: RSS sampled every 10 ms "
        "(the process had peaked higher in an earlier stage); n/e: not evaluated here (its runtime is absent); "
        f"model: how it held the model; passes: over its weights; whole s: the same work with the model loaded "
        f"whole; ratio: wall over that (target <= {CEILING_RATIO})"
    )


def _verdict(check: dict[str, Any]) -> str:
    return "PASS" if check["ok"] else "FAIL"


def _not_run(row: dict[str, Any]) -> str:
    return "n/e" if row.get("eval_status") == "not_evaluated" else "-"


def throughput_checks(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage built at both sizes: its throughput at 8B over its throughput at 1B, against 0.67."""
    by_size = {r["size"]: {s["node"]: s for s in r["stages"]} for r in results}
    if not {"1b", "8b"} <= set(by_size):
        return []
    checks = []
    for node, big in by_size["8b"].items():
        small = by_size["1b"].get(node)
        if small is None or not small["throughput_bps"] or not big["throughput_bps"]:
            continue
        ratio = big["throughput_bps"] / small["throughput_bps"]
        check: dict[str, Any] = {"node": node, "ratio": round(ratio, 3), "ok": ratio >= THROUGHPUT_RATIO}
        beside = [row["wall_s"] - row.get("disk_s", 0.0) for row in (small, big)]
        if min(beside) > 0:  # its throughput (model bytes a second) beside its disk reads, at the disk's rate
            check["disk_s"] = [small.get("disk_s"), big.get("disk_s")]
            model_s = [row["throughput_bps"] * row["wall_s"] / b for row, b in zip((small, big), beside, strict=True)]
            check["ratio_beside_disk"] = round(model_s[1] / model_s[0], 3)
        checks.append(check)
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-bench-scale")
    ap.add_argument("--targets", default=None, help="artifacts to build (default: all): e.g. gguf-f16,orbax-bf16")
    ap.add_argument("--split", action="store_true", help="one artifact (and its quantize stage) at a time")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (stage outputs) after the run")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer directory written by an earlier run (another Python's library is smaller)",
    )
    ap.add_argument("--device", default="cpu", help="kiln build --device: cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--small-eval", action="store_true", help=f"the eval budget {SMALL_EVAL} (a smoke run)")
    ap.add_argument("--host-memory", type=float, help="GiB of host memory to plan for (KILN_HOST_MEMORY): less streams")
    ap.add_argument("--ceiling", type=Path, help=argparse.SUPPRESS)  # a stage.json: time it with the model whole
    add_record_argument(ap, "scale")
    args = ap.parse_args()
    if args.ceiling is not None:
        print(json.dumps(ceiling(args.ceiling, args.device)))
        return
    args.work = args.work.resolve()
    args.budget = SMALL_EVAL if args.small_eval else EVAL

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        sys.exit(f"--sizes: unknown {', '.join(unknown)}; known: {', '.join(SIZES)}")
    names = {f"{t}-{q}": (t, q) for t, q in ARTIFACTS}
    wanted = list(names) if args.targets is None else [a.strip() for a in args.targets.split(",") if a.strip()]
    if unknown := [a for a in wanted if a not in names]:
        sys.exit(f"--targets: unknown {', '.join(unknown)}; known: {', '.join(names)}")
    artifacts = [names[a] for a in wanted]

    # Disk: what every size needs at once (the models stay; each size's work dir is deleted unless --keep).
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free
    needed = {
        s: disk_needed(
            SIZES[s], artifacts, args.split, (args.work / s / "model/model.safetensors.index.json").is_file()
        )
        for s in sizes
    }
    total = sum(n["model"] for n in needed.values())
    total += (
        sum(n["reference"] + n["artifacts"] for n in needed.values())
        if args.keep
        else max(n["reference"] + n["artifacts"] for n in needed.values())
    )
    for s, n in needed.items():
        parts = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in n.items() if v)
        print(f"disk for {s}: {parts}", file=sys.stderr)
    print(
        f"disk needed {total / 1e9:.1f} GB (+{HEADROOM / GIB:.0f} GiB headroom), free {free / 1e9:.1f} GB",
        file=sys.stderr,
    )
    if total + HEADROOM > free:
        hint = "" if args.split else "; --split builds one artifact at a time"
        sys.exit(
            f"not enough disk under {args.work}: {total / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free. "
            f"Choose fewer artifacts with --targets (of {', '.join(names)}){hint}, or another --work."
        )

    results = []
    for s in sizes:
        result = run_size(SIZES[s], args, artifacts)
        for row in result["stages"]:
            row["memory"] = check_memory(row, result["memory_target_bytes"])
            row["ceiling"] = check_ceiling(row)
        print_table(result)
        results.append(result)
    ratios = throughput_checks(results)
    if ratios:
        print(f"\nthroughput at 8B / at 1B (target >= {THROUGHPUT_RATIO}):")
        for c in ratios:
            line = f"  {c['node']:34} {c['ratio']:6.2f}  {'PASS' if c['ok'] else 'FAIL'}"
            if not c["ok"] and "ratio_beside_disk" in c:
                (small_s, big_s), beside = c["disk_s"], c["ratio_beside_disk"]
                bound = "disk-bound" if beside >= THROUGHPUT_RATIO else "not the disk alone"
                line += f"  (disk reads {small_s:.1f} s at 1B, {big_s:.1f} s at 8B; beside them {beside:.2f}: {bound})"
            print(line)
    timed = [(r["size"], row) for r in results for row in r["stages"] if row.get("ceiling")]
    if timed:
        print(
            f"\nthe reference and the transformers evals against the model loaded whole (target <= {CEILING_RATIO}x):"
        )
        for size, row in timed:
            passes = row["weights"]["passes"]
            print(
                f"  {size} {row['node']:34} {row['wall_s']:7.1f} s / {row['ceiling_s']:7.1f} s = "
                f"{row['ceiling']['ratio']:5.2f}  {_verdict(row['ceiling'])}  (CPU {row['cpu_s']:.1f} s / "
                f"{row['ceiling_cpu_s']:.1f} s = {row['ceiling']['cpu_ratio']:.2f}; {_held(row)}, {passes:.2f} passes)"
            )
    over = [(r["size"], row) for r in results for row in r["stages"] if row["memory"]["over_bytes"] > 0]
    if over:
        print(
            "\nover the memory target (held = the process's anonymous memory at the start + the stage's growth"
            " + children):"
        )
        for size, row in over:
            start = row["anon_start_bytes"] or 0
            print(
                f"  {size} {row['node']}: by {row['memory']['over_bytes'] / (1 << 20):,.0f} MiB "
                f"(start {_mib(start)}, growth {_mib((row['peak_anon_bytes'] or 0) - start)}, "
                f"children {_mib(row['children_peak_rss_bytes'])} MiB)"
            )
    record = run_record(
        sizes=sizes,
        artifacts=wanted,
        split=args.split,
        device=args.device,
        eval=args.budget,
        host_memory_gib=args.host_memory,
        disk_free_bytes=free,
        disk_needed_bytes=total,
        results=results,
        throughput_ratios=ratios,
    )
    save_record(record, args.record)


if __name__ == "__main__":
    main()
