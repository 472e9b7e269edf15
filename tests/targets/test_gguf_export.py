"""The `gguf` target as a user sees it: files llama.cpp loads, logits that agree with transformers,
tokenization that matches the HF tokenizer, and clear errors for what cannot be converted."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import pytest
import torch

from kiln.core.errors import InvalidInput
from kiln.formats.gguf.constants import LLAMA3_REGEX, FileType, Keys
from kiln.formats.hf_model import open_source
from kiln.targets.base import ExportRequest, ExportResult
from kiln.targets.gguf import SPEC
from kiln.targets.gguf.export import export
from tests.model_factory import make_model

EXAMPLE_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "model"
QUANTS = ("f16", "bf16", "q8_0", "q4_0", "mxfp4", "nvfp4", "q4_k_m", "q6_k")
# Row lengths (hidden 256, intermediate 512) are whole K-quant super-blocks, so every type applies.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2),
    "qwen2": dict(
        family="qwen2", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, tie_word_embeddings=True
    ),
    "mistral": dict(family="mistral", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, seed=1),
}
TEXT = (
    'import heapq\n\nclass Scheduler:\n    """Run the task with the earliest deadline first."""\n\n'
    "    def push(self, deadline, name):\n        heapq.heappush(self._queue, (deadline, name))  # O(log n)\n\n"
    "    def pop(self):\n        return heapq.heappop(self._queue)[1] if self._queue else None\n"
)
TOKENIZE_TEXTS = [
    TEXT,
    "Hello world! It's 2024-06-01, isn't it? They'll say we'd've DONE it.",
    "    indented\n\n\n\ttabs\t\tand   spaces   \n  ",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "unicode: café naïve 日本語 Ελληνικά emoji 🙂👍🏽 ∑∫√",
    "",
]
# HF fast tokenizers match added tokens inside text even with add_special_tokens=False; llama.cpp does
# so when asked to parse special tokens (special=True).
SPECIAL_TEXT = "first<|endoftext|>second <|endoftext|> third"


def _sharpen(model_dir: Path) -> None:
    """Scale q/k by 4 so attention is far from uniform: with the factory's small random init a wrong
    rope layout (q/k rows not permuted) would otherwise barely change the logits."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if ".q_proj." in name or ".k_proj." in name:
            tensors[name] = tensors[name] * 4
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-models")
    out = {}
    for fam, kw in FAMILIES.items():
        out[fam] = make_model(root / fam, **kw)
        _sharpen(out[fam])
    return out


@pytest.fixture(scope="module")
def exported(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], tuple[Path, ExportResult]]:
    """export(family, quant), each done once per module."""
    root = tmp_path_factory.mktemp("gguf-out")
    cache: dict[tuple[str, str], tuple[Path, ExportResult]] = {}

    def get(family: str, quant: str) -> tuple[Path, ExportResult]:
        if (family, quant) not in cache:
            out = root / f"{family}-{quant}"
            res = export(open_source(models[family]), ExportRequest(quant=quant, out_dir=out))
            cache[family, quant] = (out / res.files[0], res)
        return cache[family, quant]

    return get


@contextlib.contextmanager
def llama(path: Path, **kw: Any) -> Iterator[Any]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False, **kw)
    try:
        yield llm
    finally:
        llm.close()


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    with llama(path, logits_all=True) as llm:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)


def hf_logits(model_dir: Path, ids: list[int], state: dict[str, torch.Tensor] | None = None) -> np.ndarray:
    """fp32 transformers logits from the same bf16 weights (or from `state` replacing them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        # strict=False: norms and biases stay as loaded; every given weight must land somewhere
        assert not model.load_state_dict(state, strict=False).unexpected_keys
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def hf_ids(model_dir: Path, text: str, special: bool = False) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=special)["input_ids"])


def agreement(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    logp = torch.log_softmax(torch.from_numpy(ref), -1)
    logq = torch.log_softmax(torch.from_numpy(got), -1)
    return {
        "top1": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
        "max_abs": float(np.abs(ref - got).max()),
        "kl": float((logp.exp() * (logp - logq)).sum(-1).mean()),
    }


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> Callable[[str], tuple[list[int], np.ndarray]]:
    cache: dict[str, tuple[list[int], np.ndarray]] = {}

    def get(family: str) -> tuple[list[int], np.ndarray]:
        if family not in cache:
            ids = hf_ids(models[family], TEXT)
            cache[family] = (ids, hf_logits(models[family], ids))
        return cache[family]

    return get


def test_target_is_registered_with_what_it_supports() -> None:
    assert SPEC.name == "gguf" and SPEC.format == "gguf-v3" and SPEC.runtime == "llama.cpp"
    assert SPEC.quants == QUANTS
    assert SPEC.hardware == ("cpu", "apple-m2", "edge")
    assert SPEC.code_version


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_and_tensors_read_back(
    family: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    path, res = exported(family, "f16")
    assert res.files == ["model-f16.gguf"] and path.parent.name == f"{family}-f16"
    assert res.runtime == {"engine": "llama.cpp", "gguf_version": 3, "min_llama_cpp_python": "0.3"}
    r = gguf.GGUFReader(path)
    kw = FAMILIES[family]
    arch = "qwen2" if family == "qwen2" else "llama"

    def field(key: str) -> Any:
        return r.fields[key.format(arch=arch)].contents()

    assert field(Keys.ARCHITECTURE) == arch
    assert field(Keys.FILE_TYPE) == FileType.MOSTLY_F16
    assert field(Keys.QUANTIZATION_VERSION) == 2
    assert field(Keys.ALIGNMENT) == 32
    assert field(Keys.EMBEDDING_LENGTH) == kw["hidden_size"]
    assert field(Keys.FEED_FORWARD_LENGTH) == kw["intermediate_size"]
    assert field(Keys.HEAD_COUNT) == kw["num_heads"] and field(Keys.HEAD_COUNT_KV) == kw["num_kv_heads"]
    assert field(Keys.BLOCK_COUNT) == 2 and field(Keys.CONTEXT_LENGTH) == 512 and field(Keys.VOCAB_SIZE) == 512
    assert field(Keys.ROPE_DIMENSION_COUNT) == kw["hidden_size"] // kw["num_heads"]
    assert field(Keys.ROPE_FREQ_BASE) == pytest.approx(10000.0)
    assert field(Keys.LAYERNORM_RMS_EPS) == pytest.approx(1e-6)
    assert field(Keys.TOKENIZER_MODEL) == "gpt2"
    assert field(Keys.TOKENIZER_PRE) == ("qwen2" if family == "qwen2" else "gpt-2")  # what transformers runs
    assert len(field(Keys.TOKENS)) == 512 and field(Keys.TOKEN_TYPE)[0] == 3  # <|endoftext|>: CONTROL
    assert field(Keys.MERGES)[0] == "Ġ Ġ"
    assert field(Keys.BOS_ID) == field(Keys.EOS_ID) == 0
    assert field(Keys.ADD_BOS) is False and field(Keys.ADD_EOS) is False

    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.1.ffn_down.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert ("output.weight" in types) is (family != "qwen2")  # tied: llama.cpp reuses token_embd
    assert ("blk.0.attn_q.bias" in types) is (family == "qwen2")
    assert len(types) == len(open_source(models[family]).tensors)
    # the header is written from tokenizer.json before transformers has loaded; for Qwen2 transformers
    # rebuilds the pre-tokenizer (and adds an unk token), so the header was corrected afterwards
    assert res.details["tokenizer_header"] == ("rewritten, weights moved" if family == "qwen2" else "as predicted")


@pytest.mark.parametrize("family", FAMILIES)
def test_q_and_k_rows_are_permuted_for_llama_only(
    family: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    path, res = exported(family, "bf16")
    src = open_source(models[family])
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    heads, kv = FAMILIES[family]["num_heads"], FAMILIES[family]["num_kv_heads"]
    for hf_name, g_name, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv)):
        hf = src.tensor(f"model.layers.1.self_attn.{hf_name}.weight").view(torch.int16).numpy()
        got = np.asarray(tensors[f"blk.1.{g_name}.weight"].data).view(np.int16).reshape(hf.shape)
        if family == "qwen2":  # NEOX rope: HF layout as is
            np.testing.assert_array_equal(got, hf)
        else:  # llama.cpp's LlamaModel.permute, with the kv head count for k
            expected = hf.reshape(n, 2, hf.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(hf.shape)
            np.testing.assert_array_equal(got, expected)
    assert res.details["permuted_qk"] is (family != "qwen2")


# Agreement of llama.cpp with transformers (fp32) on the same bf16 weights. Quantized types are looser;
# a wrong rope layout scores about kl 3e-2, top1 0.25 on these models.
LIMITS = {
    "f16": dict(top1=0.98, max_abs=0.02, kl=1e-6),
    "bf16": dict(top1=0.97, max_abs=0.08, kl=2e-5),
    "q8_0": dict(top1=0.85, max_abs=0.3, kl=4e-4),
    "q6_k": dict(top1=0.7, max_abs=0.6, kl=2e-3),
    "q4_0": dict(top1=0.3, max_abs=1.5, kl=1.5e-2),
    "mxfp4": dict(top1=0.3, max_abs=1.5, kl=2.5e-2),
    "nvfp4": dict(top1=0.3, max_abs=1.5, kl=2.5e-2),
    "q4_k_m": dict(top1=0.3, max_abs=1.5, kl=1.5e-2),
}


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_logits_agree_with_transformers(
    family: str, quant: str, exported: Callable[..., tuple[Path, ExportResult]], reference: Callable[..., Any]
) -> None:
    ids, ref = reference(family)
    path, _ = exported(family, quant)
    got = agreement(ref, llama_logits(path, ids))
    lim = LIMITS[quant]
    assert got["top1"] >= lim["top1"] and got["max_abs"] <= lim["max_abs"] and got["kl"] <= lim["kl"], got


def _unpermute(w: torch.Tensor, n: int) -> torch.Tensor:
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_state(path: Path, model_dir: Path, family: str, n_layers: int = 2) -> dict[str, torch.Tensor]:
    """The weights a GGUF file holds, dequantized by gguf-py and mapped back to HF names and layout."""
    from kiln.targets.gguf.convert import layout

    places = layout(open_source(model_dir).shape)
    kw = FAMILIES[family]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = ["model.embed_tokens.weight", "model.norm.weight"] + (
        [] if kw.get("tie_word_embeddings") else ["lm_head.weight"]
    )
    for i in range(n_layers):
        names += [
            f"model.layers.{i}.{s}"
            for s in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            )
        ]
    state = {}
    for name in names:
        t = tensors[places[name][0].name]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if family != "qwen2" and "q_proj" in name:
            w = _unpermute(w, kw["num_heads"])
        elif family != "qwen2" and "k_proj" in name:
            w = _unpermute(w, kw["num_kv_heads"])
        state[name] = w
    return state


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "mxfp4", "nvfp4", "q4_k_m", "q6_k"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_file_computes_what_its_weights_say(
    family: str,
    quant: str,
    models: dict[str, Path],
    exported: Callable[..., tuple[Path, ExportResult]],
    reference: Callable[..., Any],
) -> None:
    """transformers run on the file's own dequantized weights must match llama.cpp closely: what is left
    is llama.cpp's 8-bit activations, not the weight quantization (which costs 10-100x more)."""
    ids, _ = reference(family)
    path, _ = exported(family, quant)
    ref = hf_logits(models[family], ids, dequantized_state(path, models[family], family))
    got = agreement(ref, llama_logits(path, ids))
    assert got["kl"] <= 2e-4 and got["max_abs"] <= 0.2, got


def test_k_quant_files_use_llama_cpp_type_mix(exported: Callable[..., tuple[Path, ExportResult]]) -> None:
    for quant, want_file_type, want in (
        ("q4_k_m", FileType.MOSTLY_Q4_K_M, {"Q4_K", "Q6_K"}),
        ("q6_k", FileType.MOSTLY_Q6_K, {"Q6_K"}),
        ("q4_0", FileType.MOSTLY_Q4_0, {"Q4_0", "Q8_0"}),
        ("mxfp4", FileType.MOSTLY_MXFP4_MOE, {"MXFP4", "Q8_0"}),
        ("nvfp4", FileType.MOSTLY_NVFP4, {"NVFP4", "Q8_0"}),
        ("q8_0", FileType.MOSTLY_Q8_0, {"Q8_0"}),
    ):
        path, res = exported("llama", quant)
        r = gguf.GGUFReader(path)
        assert r.fields[Keys.FILE_TYPE].contents() == want_file_type
        assert r.fields[Keys.QUANTIZATION_VERSION].contents() == 2
        types = {t.name: t.tensor_type.name for t in r.tensors}
        assert {v for k, v in types.items() if not k.endswith("norm.weight")} == want
        assert set(res.details["tensor_types"]) == want | {"F32"}
        assert not list(path.parent.glob(".*")), "intermediate or partial files left behind"
    q4 = {t.name: t.tensor_type.name for t in gguf.GGUFReader(exported("llama", "q4_0")[0]).tensors}
    assert q4["output.weight"] == "Q8_0" and q4["token_embd.weight"] == "Q4_0"
    tied = {t.name: t.tensor_type.name for t in gguf.GGUFReader(exported("qwen2", "q4_0")[0]).tensors}
    assert tied["token_embd.weight"] == "Q8_0"  # it is the output projection too


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_tokenizes_like_the_hf_tokenizer(
    family: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    path, _ = exported(family, "f16")
    _compare_tokens(path, models[family])


def _compare_tokens(path: Path, model_dir: Path) -> None:
    with llama(path, vocab_only=True) as llm:
        for text in TOKENIZE_TEXTS:
            want = hf_ids(model_dir, text)
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == want, text
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == want, text
            # add_bos=True means "add the special tokens the model adds", as add_special_tokens=True does
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf_ids(model_dir, text, True), text
        assert llm.tokenize(SPECIAL_TEXT.encode(), add_bos=False, special=True) == hf_ids(model_dir, SPECIAL_TEXT)
        assert 0 not in llm.tokenize(SPECIAL_TEXT.encode(), add_bos=False, special=False)


def _variant(models: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the llama model with its tokenizer.json edited."""
    d = tmp_path / "variant"
    shutil.copytree(models["llama"], d)
    tok = json.loads((d / "tokenizer.json").read_text())
    edit(tok)
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


def _export_and_compare_tokens(model_dir: Path, tmp_path: Path, quant: str = "f16") -> ExportResult:
    res = export(open_source(model_dir), ExportRequest(quant=quant, out_dir=tmp_path / "out"))
    _compare_tokens(tmp_path / "out" / res.files[0], model_dir)
    return res


def test_llama3_style_pre_tokenizer_is_detected(models: dict[str, Path], tmp_path: Path) -> None:
    def edit(tok: dict[str, Any]) -> None:
        tok["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
        tok["model"]["ignore_merges"] = True

    res = _export_and_compare_tokens(_variant(models, tmp_path, edit), tmp_path)
    assert res.details["tokenizer_pre"] == "llama-bpe"


def test_bos_added_by_the_hf_post_processor_is_added_by_llama_cpp(models: dict[str, Path], tmp_path: Path) -> None:
    def edit(tok: dict[str, Any]) -> None:
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
        }

    res = _export_and_compare_tokens(_variant(models, tmp_path, edit), tmp_path)
    assert res.details["add_bos"] is True


def test_unknown_pre_tokenizer_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    def edit(tok: dict[str, Any]) -> None:
        tok["pre_tokenizer"] = {"type": "Whitespace"}

    src = open_source(_variant(models, tmp_path, edit))
    with pytest.raises(InvalidInput, match="refusing to guess") as e:
        export(src, ExportRequest(quant="f16", out_dir=tmp_path / "out"))
    assert e.value.code == "GGUF_TOKENIZER_UNSUPPORTED"
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_vocab_is_padded_to_the_model_vocab_size(models: dict[str, Path], tmp_path: Path) -> None:
    """A tokenizer with fewer tokens than embedding rows: llama.cpp gets [PAD{i}] tokens, type UNUSED."""

    def edit(tok: dict[str, Any]) -> None:
        vocab = tok["model"]["vocab"]
        for text in [t for t, i in vocab.items() if i >= 500]:
            del vocab[text]
        tok["model"]["merges"] = tok["model"]["merges"][: len(tok["model"]["merges"]) - 12]

    res = _export_and_compare_tokens(_variant(models, tmp_path, edit), tmp_path)
    assert res.details["vocab_padded"] == 12
    r = gguf.GGUFReader(tmp_path / "out" / res.files[0])
    assert r.fields[Keys.TOKENS].contents()[500:] == [f"[PAD{i}]" for i in range(500, 512)]
    assert set(r.fields[Keys.TOKEN_TYPE].contents()[500:]) == {5}


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # rows of 48 values: not whole Q8_0/Q4_0 blocks (32) except ffn_down (96); none are K-quant blocks (256)
    return make_model(tmp_path_factory.mktemp("narrow") / "m", hidden_size=48, intermediate_size=96)


def test_rows_not_divisible_fall_back_and_say_so(narrow_model: Path, tmp_path: Path) -> None:
    ids = hf_ids(narrow_model, TEXT)
    ref = hf_logits(narrow_model, ids)
    for quant in ("q8_0", "q4_k_m"):
        res = export(open_source(narrow_model), ExportRequest(quant=quant, out_dir=tmp_path / quant))
        fallbacks = res.details["fallbacks"]
        assert "blk.0.attn_q.weight" in fallbacks and "not a multiple" in fallbacks["blk.0.attn_q.weight"]
        if quant == "q8_0":
            assert "blk.0.ffn_down.weight" not in fallbacks
            types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / quant / res.files[0]).tensors}
            assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "Q8_0"
        got = agreement(ref, llama_logits(tmp_path / quant / res.files[0], ids))
        assert got["kl"] <= 1e-2, (quant, got)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q6_k"])
def test_rows_not_divisible_are_an_error_when_strict(narrow_model: Path, tmp_path: Path, quant: str) -> None:
    with pytest.raises(InvalidInput, match=r"model\.embed_tokens\.weight.*48") as e:
        export(open_source(narrow_model), ExportRequest(quant=quant, out_dir=tmp_path, params={"strict_types": True}))
    assert e.value.code == "GGUF_ROW_NOT_DIVISIBLE"
    assert list(tmp_path.iterdir()) == []


def test_progress_counts_every_source_byte(models: dict[str, Path], tmp_path: Path) -> None:
    seen: list[int] = []
    src = open_source(models["qwen2"])
    export(src, ExportRequest(quant="q6_k", out_dir=tmp_path, on_progress=seen.append))
    assert sum(seen) == sum(t.nbytes for t in src.tensors.values()) and len(seen) == len(src.tensors)


def test_f16_overflow_is_refused_and_leaves_no_file(models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "big"
    shutil.copytree(models["llama"], d)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 7] = 1e6  # fine in bf16, inf in f16
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match="up_proj.*float16") as e:
        export(open_source(d), ExportRequest(quant="f16", out_dir=out))
    assert e.value.code == "GGUF_F16_OVERFLOW"
    assert list(out.iterdir()) == []
    res = export(open_source(d), ExportRequest(quant="bf16", out_dir=out))  # bf16 holds it
    assert res.files == ["model-bf16.gguf"]


def test_example_model_tokenizes_like_hf(tmp_path: Path) -> None:
    res = _export_and_compare_tokens(EXAMPLE_MODEL, tmp_path, quant="q8_0")
    assert res.details["tokenizer_pre"] == "gpt-2" and res.details["tokenizer_header"] == "as predicted"


def test_example_model_f16_logits_agree(tmp_path: Path) -> None:
    """On trained weights (confident predictions), F16 must pick the same next token nearly everywhere."""
    heldout = (EXAMPLE_MODEL.parent / "heldout.txt").read_text(encoding="utf-8")
    ids = hf_ids(EXAMPLE_MODEL, heldout)[:256]
    res = export(open_source(EXAMPLE_MODEL), ExportRequest(quant="f16", out_dir=tmp_path))
    got = agreement(hf_logits(EXAMPLE_MODEL, ids), llama_logits(tmp_path / res.files[0], ids))
    assert got["top1"] >= 0.99 and got["kl"] <= 1e-4, got


def test_unsupported_requests_are_refused_before_writing(models: dict[str, Path], tmp_path: Path) -> None:
    from kiln.core.errors import UnknownName

    with pytest.raises(UnknownName, match="q3_k_s.*known: f16, bf16"):
        export(open_source(models["llama"]), ExportRequest(quant="q3_k_s", out_dir=tmp_path / "a"))
    d = tmp_path / "scaled"
    shutil.copytree(models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInput, match="rope scaling 'llama3'") as e:
        export(open_source(d), ExportRequest(quant="f16", out_dir=tmp_path / "b"))
    assert e.value.code == "GGUF_UNSUPPORTED"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_token_transformers_adds_past_the_vocab_is_blamed_on_transformers(tmp_path: Path) -> None:
    """Qwen2Tokenizer adds '<|endoftext|>' (its default unk/eos/pad) when tokenizer_config.json names none;
    with a tokenizer.json that lacks it and ends at vocab_size - 1, the new id has no embedding row."""
    model = make_model(tmp_path / "m", "qwen2", vocab_size=512, num_heads=4, num_kv_heads=2)
    tok = json.loads((model / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["content"] = "<|sep|>"
    tok["model"]["vocab"]["<|sep|>"] = tok["model"]["vocab"].pop("<|endoftext|>")
    (model / "tokenizer.json").write_text(json.dumps(tok))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(InvalidInput) as e:
        export(open_source(model), ExportRequest(quant="f16", out_dir=tmp_path / "out"))
    assert e.value.code == "GGUF_VOCAB_MISMATCH"
    message = e.value.message
    assert message.startswith("tokenizer has token id 512 but config.json vocab_size is 512")
    assert "'<|endoftext|>', is not in tokenizer.json: transformers' Qwen2Tokenizer added it" in message
    assert "Set eos_token, unk_token, pad_token in tokenizer_config.json" in message
    assert not list(tmp_path.glob("out/*.gguf"))
