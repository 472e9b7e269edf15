"""Ingest: read a SafeTensors model release, check everything, and plan from headers alone.

`open_source(dir)` validates the directory (pickle refusal, file names, SafeTensors headers,
shapes against config.json) without reading any tensor data; `SourceModel.tensor(name)`
then materialises one tensor at a time through a memory-mapped `safe_open`, so peak memory is
bounded by the largest tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.digest import sha256_file, sha256_json
from kiln.errors import SourceInvalid, UnsafeCheckpoint
from kiln.manifest import FileEntry, check_relative_path
from pipeline.safetensors_header import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write that are recomputed at load time and carry no weights.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ArchFamily:
    """What a supported architecture looks like, as data."""

    name: str  # llama | mistral | qwen2
    attention_bias_default: bool


ARCHITECTURES: dict[str, ArchFamily] = {
    "LlamaForCausalLM": ArchFamily("llama", False),
    "MistralForCausalLM": ArchFamily("mistral", False),
    "Qwen2ForCausalLM": ArchFamily("qwen2", True),
}


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters every target needs, read once from config.json."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        archs = config.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise SourceInvalid(
                f"config.json: architectures={archs!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
                details={"field": "architectures"},
            )
        fam = ARCHITECTURES[archs[0]]

        def need_int(key: str, default: int | None = None) -> int:
            v = config.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SourceInvalid(f"config.json: {key} must be a positive integer, got {v!r}", details={"field": key})
            return v

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv_heads = need_int("num_key_value_heads", heads)
        head_dim = need_int("head_dim", hidden // heads if hidden % heads == 0 else None)
        if heads % kv_heads:
            raise SourceInvalid(
                f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                details={"field": "num_key_value_heads"},
            )
        if head_dim % 2:
            raise SourceInvalid(f"config.json: head_dim={head_dim} must be even for rotary embeddings")
        eos = config.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            architecture=archs[0],
            family=fam.name,
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_layers=need_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(
                config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            ),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=need_int("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", fam.attention_bias_default)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
        )

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every weight tensor name the checkpoint must contain, with its shape."""
        h, q, kv, ff = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
            out[p + "mlp.gate_proj.weight"] = (ff, h)
            out[p + "mlp.up_proj.weight"] = (ff, h)
            out[p + "mlp.down_proj.weight"] = (h, ff)
        return out

    def summary(self) -> dict[str, Any]:
        """What the registry keeps about the model (resolve sizes KV caches from it)."""
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }


@dataclass
class SourceModel:
    """A checked model directory: config, tokenizer and a plan of every tensor."""

    root: Path
    config: dict[str, Any]
    shape: ModelShape
    tensors: dict[str, TensorInfo]
    files: list[FileEntry]

    @property
    def digest(self) -> str:
        """Source digest: sha256 over the canonical list of (path, sha256, size)."""
        return sha256_json([f.model_dump() for f in self.files])

    @property
    def weight_files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def tokenizer_files(self) -> list[str]:
        return [f.path for f in self.files if f.path in TOKENIZER_FILES]

    def tensor(self, name: str) -> torch.Tensor:
        """Materialise one tensor (memory-mapped read) and check it is what the header planned.

        Each call opens its own `safe_open` handle: the returned tensor may be a view of that
        handle's memory map, which is released when the tensor is, so resident memory is bounded
        by the tensors the caller still holds, not by the files read so far.
        """
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(self.root / info.file), framework="pt") as handle:
            t = handle.get_tensor(name)
        if tuple(t.shape) != info.shape:
            raise SourceInvalid(f"{info.file}: tensor {name!r} loaded as {tuple(t.shape)}, header said {info.shape}")
        return t

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names if names is not None else self.tensors:
            yield name, self.tensor(name)

    def close(self) -> None:
        """Kept for callers that scope a source with try/finally; tensors hold their own mappings."""


def open_source(
    root: str | Path,
    known_files: list[FileEntry] | None = None,
    hasher: Callable[[Path], str] = sha256_file,
) -> SourceModel:
    """Validate a model directory and plan from its headers; reads no tensor data.

    Every file is hashed (with `hasher`, e.g. `kiln.digest.HashCache.sha256`) unless `known_files`
    (from a finished ingest stage, whose output is immutable and was hashed when it was committed)
    already gives the digests.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceInvalid(f"source {str(root)!r} is not a directory", details={"field": "source"})
    present = {p.name for p in root.iterdir() if p.is_file()}
    weight_files = _weight_files(root, present)
    config = _read_json(root, "config.json")
    shape = ModelShape.from_config(config)
    if "tokenizer.json" not in present:
        raise SourceInvalid(
            "source has no tokenizer.json (a fast BPE tokenizer is required)", details={"file": "tokenizer.json"}
        )

    tensors: dict[str, TensorInfo] = {}
    for wf in weight_files:
        infos, _meta = read_header(root / wf, wf)
        for t in infos:
            if t.name in tensors:
                raise SourceInvalid(f"tensor {t.name!r} appears in both {tensors[t.name].file} and {wf}")
            tensors[t.name] = t
    if INDEX_FILE in present:
        _check_index(root, tensors)
    tensors = {n: t for n, t in tensors.items() if not n.endswith(IGNORED_TENSOR_SUFFIXES)}
    _check_against_config(shape, tensors)

    used = [*CONFIG_FILES, *TOKENIZER_FILES, *([INDEX_FILE] if INDEX_FILE in present else []), *weight_files]
    known = {f.path: f for f in known_files or []}
    files = [
        known[p] if p in known else FileEntry(path=p, sha256=hasher(root / p), size=(root / p).stat().st_size)
        for p in used
        if p in present
    ]
    expected = shape.expected_tensors()
    ordered = {n: tensors[n] for n in expected}  # canonical order: embeddings, layers, norm, head
    return SourceModel(root=root, config=config, shape=shape, tensors=ordered, files=files)


def _weight_files(root: Path, present: set[str]) -> list[str]:
    pickles = sorted(p for p in present if p.endswith(PICKLE_SUFFIXES))
    if INDEX_FILE in present:
        index = _read_json(root, INDEX_FILE)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise SourceInvalid(f"{INDEX_FILE}: weight_map must be a non-empty object", details={"file": INDEX_FILE})
        files = sorted(set(wmap.values()))
    elif SINGLE_FILE in present:
        files = [SINGLE_FILE]
    else:
        if pickles:
            raise UnsafeCheckpoint(
                f"source holds only pickle checkpoints ({', '.join(pickles)}); pickle files can run arbitrary code "
                "when loaded, so kiln accepts SafeTensors only. Convert them with safetensors first.",
                details={"files": pickles},
            )
        raise SourceInvalid(f"source has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        if not isinstance(f, str):
            raise SourceInvalid(f"{INDEX_FILE}: file names must be strings, got {f!r}")
        try:
            check_relative_path(f)
        except ValueError as e:
            raise UnsafeCheckpoint(f"{INDEX_FILE}: {e}", details={"file": f}) from None
        if "/" in f or not f.endswith(".safetensors"):
            raise UnsafeCheckpoint(f"weight file {f!r} must be a .safetensors file in the source directory")
        if f not in present:
            raise SourceInvalid(f"weight file {f!r} is missing", details={"file": f})
    return files


def _check_index(root: Path, tensors: dict[str, TensorInfo]) -> None:
    wmap: dict[str, str] = _read_json(root, INDEX_FILE)["weight_map"]
    for name, f in wmap.items():
        if name not in tensors:
            raise SourceInvalid(f"{INDEX_FILE}: tensor {name!r} is not in {f}", details={"tensor": name})
        if tensors[name].file != f:
            raise SourceInvalid(
                f"{INDEX_FILE}: tensor {name!r} is listed in {f} but found in {tensors[name].file}",
                details={"tensor": name},
            )
    extra = sorted(set(tensors) - set(wmap))
    if extra:
        raise SourceInvalid(
            f"{INDEX_FILE}: tensors not listed in the index: {extra[:5]}", details={"tensors": extra[:20]}
        )


def _check_against_config(shape: ModelShape, tensors: dict[str, TensorInfo]) -> None:
    expected = shape.expected_tensors()
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise SourceInvalid(
            f"{len(missing)} tensor(s) required by config.json are missing, e.g. {missing[0]!r}",
            details={"missing": missing[:20]},
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SourceInvalid(
            f"{len(unexpected)} tensor(s) not expected for {shape.architecture} with this config, "
            f"e.g. {unexpected[0]!r}",
            details={"unexpected": unexpected[:20]},
        )
    for name, want in expected.items():
        t = tensors[name]
        if t.shape != want:
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(want)}",
                details={"tensor": name, "shape": list(t.shape), "expected": list(want)},
            )
        if t.dtype not in ("F32", "F16", "BF16"):
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has dtype {t.dtype}; source weights must be F32, F16 or BF16"
            )


def _read_json(root: Path, name: str) -> dict[str, Any]:
    path = root / name
    if not path.is_file():
        raise SourceInvalid(f"source has no {name}", details={"file": name})
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceInvalid(f"{name}: not valid JSON ({e})", details={"file": name}) from None
    if not isinstance(value, dict):
        raise SourceInvalid(f"{name}: must be a JSON object", details={"file": name})
    return value
