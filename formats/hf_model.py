"""A Hugging Face model directory (config.json, tokenizer, SafeTensors weights): read a release,
check everything, and plan from headers alone.

`open_source(dir)` validates the directory (pickle refusal, file names, links and file types,
config.json's types and bounds through its family's record in `formats.architectures`, SafeTensors
headers, every tensor's name and shape against what config.json implies) without reading any tensor
data; `SourceModel.tensor(name)` then materialises one tensor at a time through a memory-mapped
`safe_open`, so peak memory is bounded by the largest tensor. The ingest stage
(`pipeline.stages.ingest`) links what this checked into the content-addressed store.

A pre-quantized release (config.json's `quantization_config`: FP8 block, MXFP4; `formats.prequantized`) is
planned by its released tensors: each quantized weight and its scales are paired and checked from the headers,
and stand, under the released name and shape, for the tensor config.json implies. Reading one of them is
explicit: `dequantized` (the float weight, with what that means recorded by the caller) or `stored` (its
bytes as released); `tensor` refuses it (SOURCE_STORED_QUANTIZED), so no stage upcasts it without saying so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.digest import sha256_file, sha256_json
from kiln.core.errors import SourceInvalid, UnsafeCheckpoint
from kiln.core.manifest import FileEntry, check_relative_path
from kiln.core.untrusted import InvalidJSON, loads_json, short_repr
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.prequantized import (
    QuantizationRecord,
    QuantizedPlan,
    StoredQuantized,
    check_scale,
    check_undeclared,
    declares_prequantized,
    dequantize_stream,
    plan_quantized,
    read_quantization,
)
from kiln.formats.safetensors import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PICKLE_REASON = "pickle checkpoint: never loaded"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write that are recomputed at load time and carry no weights.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclass
class SourceModel:
    """A checked model directory: config, tokenizer and a plan of every tensor."""

    root: Path
    config: dict[str, Any]
    shape: ModelShape
    tensors: dict[str, TensorInfo]
    files: list[FileEntry]
    # Files in the directory that kiln does not use and a user might think it does, and why.
    ignored: list[tuple[str, str]] = field(default_factory=list)
    # Directories outside `root` that symbolic links among the used files may point into.
    allowed_roots: tuple[Path, ...] = ()
    # Tensors the checkpoint carries that its record recognises and kiln builds nothing from (DeepSeek-V3's
    # multi-token-prediction layer), and why: checked by name and shape, kept in the source, never read.
    unused_tensors: list[tuple[str, str]] = field(default_factory=list)
    # A pre-quantized release's quantized tensors (by released name; in `tensors` under that name and shape).
    quantized: QuantizedPlan | None = None

    @property
    def digest(self) -> str:
        """Source digest: sha256 over the canonical list of (path, sha256, size)."""
        return sha256_json([f.model_dump() for f in self.files])

    @property
    def weight_files(self) -> list[str]:
        scales = [qt.scale.file for qt in self.quantized.tensors.values()] if self.quantized else []
        return sorted({*(t.file for t in self.tensors.values()), *scales})

    @property
    def quantization(self) -> QuantizationRecord | None:
        """The source's quantization as checked (None: its weights are plain floats)."""
        return self.quantized.record() if self.quantized is not None else None

    def is_quantized(self, name: str) -> bool:
        return self.quantized is not None and name in self.quantized.tensors

    @property
    def tokenizer_files(self) -> list[str]:
        return [f.path for f in self.files if f.path in TOKENIZER_FILES]

    def tensor(self, name: str) -> torch.Tensor:
        """Materialise one tensor (memory-mapped read) and check it is what the header planned.

        Each call opens its own `safe_open` handle: the returned tensor may be a view of that
        handle's memory map, which is released when the tensor is, so resident memory is bounded
        by the tensors the caller still holds, not by the files read so far. A tensor the release
        stores quantized is refused (SOURCE_STORED_QUANTIZED): read it with `dequantized` or `stored`.
        """
        if self.is_quantized(name):
            assert self.quantized is not None
            raise StoredQuantized(
                f"{name} is stored {self.quantized.quantization.layout.name} in the source: read it dequantized "
                "(and record that) or as its stored tensors",
                details={"tensor": name, "layout": self.quantized.quantization.layout.name},
            )
        return self._read(self.tensors[name])

    def _read(self, info: TensorInfo) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.root / info.file), framework="pt") as handle:
            t = handle.get_tensor(info.name)
        if tuple(t.shape) != info.shape:
            raise SourceInvalid(
                f"{info.file}: tensor {info.name!r} loaded as {tuple(t.shape)}, header said {info.shape}"
            )
        return t

    def check_scales(self) -> None:
        """Read and check every quantized tensor's scales (`formats.prequantized.check_scale`), one at a time."""
        if self.quantized is None:
            return
        for qt in self.quantized.tensors.values():
            check_scale(self.quantized.quantization, qt, self._read(qt.scale))

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names if names is not None else self.tensors:
            yield name, self.tensor(name)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors the release stores for `name`, by their stored names: a quantized tensor's values and
        scales, as they are (what a target that keeps the source's format writes), or the tensor itself."""
        if not self.is_quantized(name):
            return {name: self.tensor(name)}
        assert self.quantized is not None
        return {p.name: self._read(p) for p in self.quantized.tensors[name].parts}

    def dequantized(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`name` as a float tensor: a quantized one dequantized into `dtype` (float32 when None) after its
        scales and values are checked (`formats.prequantized.dequantize`), any other as stored."""
        ((_, t),) = self.iter_dequantized([name], dtype)
        return t

    def iter_dequantized(
        self, names: Iterable[str] | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`(released name, tensor)` one tensor at a time (`formats.prequantized.dequantize_stream`): each
        quantized tensor dequantized into `dtype` (float32 when None), every other as stored (not cast)."""
        wanted = list(names if names is not None else self.tensors)
        if self.quantized is None:
            yield from self.iter_tensors(wanted)
            return
        plan = self.quantized

        def stored() -> Iterator[tuple[str, torch.Tensor]]:
            for name in wanted:
                parts = plan.tensors[name].parts if name in plan.tensors else (self.tensors[name],)
                for p in parts:  # values next to their scales: the stream holds one tensor's parts at a time
                    yield p.name, self._read(p)

        yield from dequantize_stream(plan, stored(), dtype)

    def close(self) -> None:
        """Kept for callers that scope a source with try/finally; tensors hold their own mappings."""


# A file's digest where none was recorded: a source planned without hashing (its node gets no key), or a working
# copy no key is made from (calibration's dequantized release).
UNRECORDED_DIGEST = "0" * 64


def unrecorded(path: Path) -> str:
    """`open_source`'s hasher for files whose digests nobody will read."""
    return UNRECORDED_DIGEST


def open_source(
    root: str | Path,
    known_files: list[FileEntry] | None = None,
    hasher: Callable[[Path], str] = sha256_file,
    allowed_roots: Iterable[str | Path] = (),
) -> SourceModel:
    """Validate a model directory and plan from its headers; reads no tensor data.

    Every file kiln uses must be a regular file in `root`, or a symbolic link to one inside `root` or
    inside one of `allowed_roots` (the CLI's `--allow-outside`); links that leave them, dangling links,
    FIFOs and devices are refused before anything is read. Files kiln does not use but a user may
    think it does (pickle checkpoints beside SafeTensors, SafeTensors files the index does not name)
    are listed in `SourceModel.ignored` with the reason.

    Every file is hashed (with `hasher`, e.g. `core.digest.HashCache.sha256`) unless `known_files`
    (from a finished ingest stage, whose output is immutable and was hashed when it was committed)
    already gives the digests.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceInvalid(f"source {str(root)!r} is not a directory", details={"field": "source"})
    roots = (root.resolve(), *(Path(r).resolve() for r in allowed_roots))
    try:
        present = {p.name for p in root.iterdir()}
    except OSError as e:
        raise SourceInvalid(f"source {str(root)!r} cannot be listed ({e.strerror or e})") from None

    def checked(name: str) -> bool:
        if name not in present:
            return False
        _check_file(root, name, roots)
        return True

    checked(INDEX_FILE)  # before it is read for the weight file names
    weight_files, ignored = _weight_files(root, present)
    for wf in weight_files:
        checked(wf)
    checked("config.json")
    config = _read_json(root, "config.json", MAX_CONFIG_BYTES)
    shape = ModelShape.from_config(config)
    used = [*CONFIG_FILES, *TOKENIZER_FILES, *([INDEX_FILE] if INDEX_FILE in present else []), *weight_files]
    used = [p for p in used if checked(p)]
    if "tokenizer.json" not in used:
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
    quantization = read_quantization(config)
    if quantization is None:
        check_undeclared(tensors)
    quantized = plan_quantized(quantization, tensors) if quantization is not None else None
    if quantized is not None:  # each quantized tensor by its released name and shape, its scales paired with it
        tensors = quantized.released(tensors)
    unused = _recognised_extras(shape, tensors)  # by released name: a release quantizes its prediction layer too
    tensors = {n: t for n, t in tensors.items() if n not in unused}
    _check_against_config(shape, tensors, set(quantized.tensors) - set(unused) if quantized else set())

    known = {f.path: f for f in known_files or []}
    files = [
        known[p] if p in known else FileEntry(path=p, sha256=hasher(root / p), size=(root / p).stat().st_size)
        for p in used
    ]
    expected = shape.expected_tensors()
    ordered = {n: tensors[n] for n in expected}  # canonical order: embeddings, layers, norm, head
    return SourceModel(
        root=root,
        config=config,
        shape=shape,
        tensors=ordered,
        files=files,
        ignored=ignored,
        allowed_roots=roots[1:],
        unused_tensors=[(n, reason) for n, reason in unused.items()],
        quantized=quantized,
    )


def write_dequantized(source: SourceModel, out: Path, dtype: str) -> Path:
    """A plain copy of a pre-quantized source in `out` (a new directory): its config.json without
    `quantization_config`, its tokenizer and generation config, and one SafeTensors file of every tensor kiln builds
    from (`source.tensors`, the prediction layers left out) in `dtype` ("bfloat16" or "float32"), each quantized one
    dequantized (`SourceModel.dequantized`), written one tensor at a time. For a library that can read only a plain
    checkpoint from disk (llm-compressor's calibration, through transformers' disk offload): what it reads is the
    release's dequantized weights, rounded to `dtype`, and the caller records that it dequantized."""
    import json

    import torch

    from kiln.formats.safetensors import SafeTensorsWriter

    if source.quantized is None:
        raise ValueError(f"{source.root} is not a pre-quantized source")
    names = {"bfloat16": "BF16", "float32": "F32"}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {', '.join(names)}, got {dtype!r}")
    out.mkdir(parents=True)
    config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", *source.tokenizer_files):
        if (source.root / name).is_file():
            (out / name).write_bytes((source.root / name).read_bytes())
    writer = SafeTensorsWriter(out / SINGLE_FILE, metadata={"format": "pt"})
    for name, info in source.tensors.items():
        writer.add(name, names[dtype], info.shape)
    writer.begin()
    try:
        for name in source.tensors:
            t = source.dequantized(name).to(getattr(torch, dtype)).contiguous()
            writer.write(name, t.reshape(-1).view(torch.uint8).numpy().tobytes())
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return out


def quantized_plan(root: str | Path) -> QuantizedPlan | None:
    """A model directory's pre-quantized tensors (`formats.prequantized`), planned from config.json and the
    SafeTensors headers alone (nothing hashed, no tensor read; `open_source` checks the rest): None for a
    plain checkpoint, or one whose `quantization_config` is not a release layout (a compressed-tensors bundle)."""
    root = Path(root)
    config = _read_json(root, "config.json", MAX_CONFIG_BYTES)
    if not declares_prequantized(config):
        return None
    quantization = read_quantization(config)
    assert quantization is not None
    weight_files, _ = _weight_files(root, {p.name for p in root.iterdir()})
    tensors = {t.name: t for wf in weight_files for t in read_header(root / wf, wf)[0]}
    return plan_quantized(quantization, tensors)


def is_shape_only(root: str | Path) -> bool:
    """Whether the directory `root` is a shape-only source: config.json and no weights of any kind (no
    SafeTensors, no index, no pickle checkpoint, which `open_source` refuses rather than plan around). Reads
    only the listing."""
    root = Path(root)
    try:
        names = {p.name for p in root.iterdir()}
    except OSError:
        return False
    weights = INDEX_FILE in names or any(n.endswith((".safetensors", *PICKLE_SUFFIXES)) for n in names)
    return "config.json" in names and not weights


def open_shape(root: str | Path, allowed_roots: Iterable[str | Path] = ()) -> tuple[dict[str, Any], ModelShape]:
    """A shape-only source: config.json alone, checked as `open_source` checks it (a regular file in `root`
    or a link into `allowed_roots`, within the size limit, every key kiln reads valid); reads nothing else."""
    root = Path(root)
    if not root.is_dir():
        raise SourceInvalid(f"source {str(root)!r} is not a directory", details={"field": "source"})
    path = root / "config.json"
    if path.is_symlink() or path.exists():  # else _read_json says the source has none
        _check_file(root, "config.json", (root.resolve(), *(Path(r).resolve() for r in allowed_roots)))
    config = _read_json(root, "config.json", MAX_CONFIG_BYTES)
    return config, ModelShape.from_config(config)


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_file(root: Path, name: str, roots: tuple[Path, ...]) -> None:
    """Refuse a used file that is not a regular file, or a link that leaves `roots` (the source first)."""
    path = root / name
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            target = Path(os.path.realpath(path))
            if not any(target.is_relative_to(r) for r in roots):
                allowed = "" if len(roots) == 1 else f" or the allowed directories ({', '.join(map(str, roots[1:]))})"
                raise UnsafeCheckpoint(
                    f"{name} is a symbolic link to {str(target)!r}, outside the source directory {str(roots[0])!r}"
                    f"{allowed}; kiln does not follow it (allow that directory with --allow-outside DIR)",
                    details={"file": name, "link_target": str(target)},
                )
            st = target.stat()
    except FileNotFoundError:
        what = f"is a symbolic link to {os.readlink(path)!r}, which" if path.is_symlink() else "disappeared: it"
        raise SourceInvalid(f"{name} {what} does not exist", details={"file": name}) from None
    except (OSError, RuntimeError) as e:  # a link loop, a permission problem
        raise SourceInvalid(
            f"{name} cannot be read ({getattr(e, 'strerror', None) or e})", details={"file": name}
        ) from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise SourceInvalid(f"{name} is {kind}, not a regular file", details={"file": name})


def _weight_files(root: Path, present: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The SafeTensors files to read, and the weight-like files left alone with the reason."""
    pickles = sorted(p for p in present if p.endswith(PICKLE_SUFFIXES))
    if INDEX_FILE in present:
        index = _read_json(root, INDEX_FILE, MAX_INDEX_BYTES)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise SourceInvalid(f"{INDEX_FILE}: weight_map must be a non-empty object", details={"file": INDEX_FILE})
        bad = next((f for f in wmap.values() if not isinstance(f, str)), None)
        if bad is not None:
            raise SourceInvalid(f"{INDEX_FILE}: file names must be strings, got {short_repr(bad)}")
        files = sorted(set(wmap.values()))
        unused = f"not named by {INDEX_FILE}: never read"
    elif SINGLE_FILE in present:
        files = [SINGLE_FILE]
        unused = f"no {INDEX_FILE}, so only {SINGLE_FILE} is read"
    else:
        if pickles:
            raise UnsafeCheckpoint(
                f"source holds only pickle checkpoints ({', '.join(pickles)}); pickle files can run arbitrary code "
                "when loaded, so kiln accepts SafeTensors only. Convert them with safetensors first.",
                details={"files": pickles},
            )
        raise SourceInvalid(f"source has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        try:
            check_relative_path(f)
        except ValueError as e:
            raise UnsafeCheckpoint(f"{INDEX_FILE}: {e}", details={"file": f}) from None
        if "/" in f or not f.endswith(".safetensors"):
            raise UnsafeCheckpoint(f"weight file {short_repr(f)} must be a .safetensors file in the source directory")
        if f not in present:
            raise SourceInvalid(f"weight file {f!r} is missing", details={"file": f})
    ignored = [(p, PICKLE_REASON) for p in pickles]
    ignored += [(p, unused) for p in sorted(present) if p.endswith(".safetensors") and p not in files]
    return files, ignored


def _check_index(root: Path, tensors: dict[str, TensorInfo]) -> None:
    wmap: dict[str, str] = _read_json(root, INDEX_FILE, MAX_INDEX_BYTES)["weight_map"]
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


def _recognised_extras(shape: ModelShape, tensors: dict[str, TensorInfo]) -> dict[str, str]:
    """The tensors beyond what config.json implies that the family's record recognises (`ModelShape.extra_tensors`),
    with the reason kiln builds nothing from them: all of them or none, each of the shape the config implies."""
    extras = {t.name: t.shape for t in shape.extra_tensors()}
    present = [n for n in extras if n in tensors]
    if not present:
        return {}
    missing = [n for n in extras if n not in tensors]
    if missing:
        raise SourceInvalid(
            f"the checkpoint holds {len(present)} of the {len(extras)} tensors of {shape.architecture}'s "
            f"multi-token-prediction layers (num_nextn_predict_layers={shape.prediction_layers}), e.g. it lacks "
            f"{missing[0]!r}",
            details={"missing": missing[:20]},
        )
    for name in present:
        t = tensors[name]
        if t.shape != extras[name]:
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(extras[name])}",
                details={"tensor": name, "shape": list(t.shape), "expected": list(extras[name])},
            )
    reason = shape.arch.prediction_layers.reason if shape.arch.prediction_layers is not None else ""
    return dict.fromkeys(present, reason)


def _check_against_config(shape: ModelShape, tensors: dict[str, TensorInfo], quantized: set[str]) -> None:
    """The tensors (by released name) are exactly those config.json implies, with its shapes; the plain ones
    in a float dtype (the `quantized` ones' dtypes were checked against their layout)."""
    # Count first: the expected names are only built for a config the headers can satisfy.
    if shape.tensor_count != len(tensors):
        experts = f", {shape.moe.experts} experts in {len(shape.moe.sparse_layers)} layers" if shape.moe else ""
        raise SourceInvalid(
            f"config.json implies {shape.tensor_count} tensors ({shape.num_layers} layers{experts}, "
            f"tie_word_embeddings={shape.tie_word_embeddings}, attention_bias={shape.attention_bias}) "
            f"but the SafeTensors headers hold {len(tensors)}",
            details={"expected_count": shape.tensor_count, "count": len(tensors)},
        )
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
        if t.dtype not in ("F32", "F16", "BF16") and name not in quantized:
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has dtype {t.dtype}; source weights must be F32, F16 or BF16"
            )


def _read_json(root: Path, name: str, max_bytes: int) -> dict[str, Any]:
    path = root / name
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise SourceInvalid(f"source has no {name}", details={"file": name}) from None
    except OSError as e:
        raise SourceInvalid(f"{name}: cannot be read ({e.strerror or e})", details={"file": name}) from None
    if len(raw) > max_bytes:
        raise SourceInvalid(f"{name}: larger than the {max_bytes}-byte limit", details={"file": name})
    try:
        # Numbers past a float's range reach the config schema as infinity, which then names the field.
        value = loads_json(raw, what=name, finite_numbers=False)
    except InvalidJSON as e:
        raise SourceInvalid(e.message, details={"file": name}) from None
    if not isinstance(value, dict):
        raise SourceInvalid(f"{name}: must be a JSON object", details={"file": name})
    return value
