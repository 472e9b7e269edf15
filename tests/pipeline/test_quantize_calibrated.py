"""Calibrated int4 (GPTQ, AWQ) through llm-compressor on CPU: bundles transformers loads, better than RTN."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInput
from kiln.formats.hf_model import open_source
from kiln.pipeline.records import QuantizeRecord
from kiln.quant.calibrated import CalibrationTooShort, calibrate, calibration_dtype, calibration_samples
from kiln.quant.catalog import get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest
from kiln.targets.hf_bundle.export import export
from tests.model_factory import make_model

CALIBRATED = ["w4a16-gptq", "w4a16-awq"]


def _stdlib_text(*names: str) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / n).read_text(encoding="utf-8") for n in names)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 128 / intermediate 256: every Linear input width is a multiple of the group of 128.
    return make_model(tmp_path_factory.mktemp("llama128"), hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def held_out(model_dir: Path):
    """Tokens calibration never sees (another file), for scoring."""
    import torch

    from kiln.eval.text import tokenize_text

    text = tokenize_text(model_dir, _stdlib_text("heapq.py"), window=128, max_tokens=512, prompts=0)
    return torch.tensor([list(w) for w in text.windows if len(w) == 128])


@pytest.fixture(scope="module")
def bundles(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    source = open_source(model_dir)
    samples = calibration_samples(model_dir, _stdlib_text("argparse.py"), samples=8, seq_len=128)
    out: dict[str, Path] = {}
    for name in ["int4-rtn", *CALIBRATED]:
        scheme = get_scheme(name)
        root = tmp_path_factory.mktemp(name)
        cal = calibrate(source, scheme, samples) if scheme.calibrated else None
        (root / "q").mkdir()
        write_quantized(source, scheme, root / "q", calibrated=cal)
        export(source, ExportRequest(quant=name, out_dir=root, quantized=open_quantized(root / "q", name)))
        out[name] = root
    return out


def _layer_outputs(path: Path, ids):
    """Every decoder layer's output hidden states (transformers on CPU, float32 math)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=ids, output_hidden_states=True).hidden_states[1:]


@pytest.mark.parametrize("name", CALIBRATED)
def test_calibrated_bundle_loads_and_beats_rtn_on_layer_outputs(
    name: str, bundles: dict[str, Path], model_dir: Path, held_out
) -> None:
    import json

    config = json.loads((bundles[name] / "config.json").read_text())["quantization_config"]
    rtn_config = json.loads((bundles["int4-rtn"] / "config.json").read_text())["quantization_config"]
    # The same compressed-tensors layout (hf-bundle and eval need no change); GPTQ's records its column order.
    order = config["config_groups"]["group_0"]["weights"].pop("actorder")
    assert order == ("static" if name == "w4a16-gptq" else None)
    assert rtn_config["config_groups"]["group_0"]["weights"].pop("actorder") is None
    assert config == rtn_config
    reference = _layer_outputs(model_dir, held_out)
    rtn = _layer_outputs(bundles["int4-rtn"], held_out)
    calibrated = _layer_outputs(bundles[name], held_out)

    def err(out, layer: int) -> float:
        return float((out[layer] - reference[layer]).norm() / reference[layer].norm())

    # The first layer's output: calibration chose better int4 values than round-to-nearest.
    assert err(calibrated, 0) < err(rtn, 0), (name, err(calibrated, 0), err(rtn, 0))
    assert err(calibrated, -1) < err(rtn, -1), (name, err(calibrated, -1), err(rtn, -1))


@pytest.mark.parametrize("name", CALIBRATED)
def test_disk_offloaded_calibration_equals_oneshot_on_the_model_in_memory(
    name: str, model_dir: Path, tmp_path: Path
) -> None:
    """`calibrate` keeps the weights on disk between layers; that must change no number.

    The reference is what `calibrate` did before: the whole model loaded into memory, then `oneshot`.
    """
    import gc

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from kiln.quant.calibrated import _recipe, cpu_pin_memory_workaround

    scheme = get_scheme(name)
    samples = calibration_samples(model_dir, _stdlib_text("argparse.py"), samples=4, seq_len=64)
    calibrated = calibrate(open_source(model_dir), scheme, samples, offload_dir=tmp_path)
    (folder,) = tmp_path.iterdir()  # the offloaded weights live here while the result does
    assert any(folder.iterdir())

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    source = {n: t.clone() for n, t in model.state_dict().items()}
    data = {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
    with cpu_pin_memory_workaround():
        oneshot(
            model=model,
            dataset=Dataset.from_dict(data),
            recipe=_recipe(scheme),
            num_calibration_samples=4,
            max_seq_length=64,
            shuffle_calibration_samples=False,
        )
    reference = model.state_dict()
    quantized = {n.removesuffix("_scale") for n in reference if n.endswith(".weight_scale")}
    assert set(calibrated.weights) == set(calibrated.scales) == quantized
    for n in calibrated.weights:
        assert torch.equal(calibrated.weights[n], reference[n]), n
        assert torch.equal(calibrated.scales[n], reference[n.removesuffix(".weight") + ".weight_scale"]), n
    kept = [n for n in source if n not in quantized]
    assert bool(calibrated.changed) == (scheme.method == "awq")  # AWQ folds its smoothing into the norms
    assert sorted(calibrated.changed) == sorted(n for n in kept if not torch.equal(source[n], reference[n]))
    for n, t in calibrated.changed.items():
        assert torch.equal(t, reference[n]), n

    del calibrated
    gc.collect()
    assert not folder.exists()


def test_awq_stores_its_smoothed_norms(bundles: dict[str, Path]) -> None:
    awq = open_quantized(bundles["w4a16-awq"] / "q", "w4a16-awq")
    norms = [n for n in awq.tensors if n.endswith("layernorm.weight")]
    assert norms and all(awq.replaces(n) and awq.module_tensors(n) == [n] for n in norms)
    gptq = open_quantized(bundles["w4a16-gptq"] / "q", "w4a16-gptq")
    assert not [n for n in gptq.tensors if n.endswith("norm.weight")]  # GPTQ changes only the Linear weights


def test_too_short_calibration_text_is_an_error(model_dir: Path) -> None:
    with pytest.raises(CalibrationTooShort) as e:
        calibration_samples(model_dir, "def f():\n    return 1\n" * 20, samples=8, seq_len=128)
    assert e.value.code == "CALIBRATION_TOO_SHORT" and "8 samples of 128 tokens" in e.value.message
    # Skipping the eval's tokens counts against the text too.
    text = _stdlib_text("heapq.py")
    calibration_samples(model_dir, text, samples=4, seq_len=128)
    with pytest.raises(CalibrationTooShort, match="after the 1000000 skipped"):
        calibration_samples(model_dir, text, samples=4, seq_len=128, skip_tokens=1_000_000)


def test_recipe_calibration_defaults_to_eval_text_after_its_scored_tokens(model_dir: Path, tmp_path: Path) -> None:
    from kiln.core.errors import RecipeInvalid
    from kiln.pipeline.build import plan
    from kiln.pipeline.recipe import parse_recipe
    from kiln.pipeline.store import WorkDir

    (tmp_path / "text.txt").write_text(_stdlib_text("heapq.py"))
    base = {
        "model": "m",
        "version": "1",
        "source": str(model_dir),
        "eval": {"text": "text.txt", "max_tokens": 512},
        "targets": [{"target": "hf-bundle", "quants": ["int4-rtn", "w4a16-gptq"]}],
    }
    outside = [model_dir]  # the model lives in a shared fixture directory, not beside the recipe
    nodes = {
        n.id: n for n in plan(parse_recipe(base, base_dir=tmp_path, allowed_roots=outside), WorkDir(tmp_path / "w"))
    }
    assert nodes["quantize/w4a16-gptq"].params["calibration"] == {
        "samples": 32,
        "seq_len": 256,
        "skip_tokens": 512,
        "compute_dtype": calibration_dtype(),  # this CPU's: part of the key
    }
    assert "calibration_text" in nodes["quantize/w4a16-gptq"].external
    assert "calibration" not in nodes["quantize/int4-rtn"].params
    (tmp_path / "calib.txt").write_text("x")
    own = parse_recipe(
        {**base, "calibration": {"text": "calib.txt", "samples": 4}}, base_dir=tmp_path, allowed_roots=outside
    )
    assert own.calibration_skip_tokens == 0
    with pytest.raises(RecipeInvalid, match="calibration.text"):
        parse_recipe({**base, "calibration": {"text": "missing.txt"}}, base_dir=tmp_path, allowed_roots=outside)
    with pytest.raises(RecipeInvalid, match="calibration.samples"):
        parse_recipe({**base, "calibration": {"samples": 0}}, base_dir=tmp_path)


def test_upstream_awq_still_pins_memory_on_cpu() -> None:
    """The reason for `cpu_pin_memory_workaround`: when this test fails, upstream fixed it; remove the patch.

    llm-compressor 0.14's AWQ calls `IntermediatesCache.pin_memory` on the cached activations before
    every grid search; without an accelerator torch cannot pin memory and raises.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    from kiln.quant.calibrated import cpu_pin_memory_workaround

    if torch.accelerator.is_available():
        pytest.skip("pinning works with an accelerator; the workaround is a no-op there")
    cache = IntermediatesCache.from_dataloader([{"hidden_states": torch.ones(2, 4)}])
    with pytest.raises(RuntimeError):
        cache.pin_memory(0)
    with cpu_pin_memory_workaround():
        cache.pin_memory(0)  # the workaround: a no-op
    with pytest.raises(RuntimeError):
        cache.pin_memory(0)  # and only inside it


def test_upstream_offset_norm_restore_still_loses_offloaded_weights(tmp_path: Path) -> None:
    """The reason for `offset_norm_restore_workaround`: when this test fails, upstream fixed it; remove the patch.

    llm-compressor 0.14's `norm_calibration_context` restores Gemma's (1 + w) norms by assigning
    `original.weight.data`, which on a disk-offloaded module is a copy: what AWQ smoothed is lost.
    """
    import torch
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor.modeling.offset_norm import norm_calibration_context
    from transformers import AutoModelForCausalLM

    from kiln.quant.calibrated import offset_norm_restore_workaround

    source = make_model(tmp_path / "gemma3", "gemma3", vocab_size=384)
    with load_offloaded_model(AutoModelForCausalLM):
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=torch.bfloat16, device_map={"": "disk"}, offload_folder=str(tmp_path / "offload")
        )
    name = "model.layers.0.pre_feedforward_layernorm"
    before = model.get_submodule(name).weight.detach().clone()

    def smoothed_by_half() -> torch.Tensor:
        with norm_calibration_context(model):
            norm = model.get_submodule(name)  # holds 1 + w while calibrating
            norm.weight.data.div_(2)  # what AWQ's smoothing does to it
        return model.get_submodule(name).weight.detach().float()

    assert torch.equal(smoothed_by_half(), before.float())  # upstream: lost
    with offset_norm_restore_workaround():
        after = smoothed_by_half()
    want = ((1.0 + before.float()).to(torch.bfloat16).float() / 2 - 1.0).to(torch.bfloat16).float()
    assert torch.equal(after, want)


def test_quantize_stage_keeps_calibration_offload_inside_its_work_dir(model_dir: Path, tmp_path: Path) -> None:
    """The stage gives calibration a folder in its own temporary directory and leaves nothing behind."""
    from kiln.pipeline.executors.local import LocalExecutor
    from kiln.pipeline.stage import Node
    from kiln.pipeline.stages import ingest as ingest_stage
    from kiln.pipeline.stages import quantize as quantize_stage
    from kiln.pipeline.store import WorkDir

    text = tmp_path / "calibration.txt"
    text.write_text(_stdlib_text("argparse.py"), encoding="utf-8")
    work = WorkDir(tmp_path / "work")
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    work.put_external(text, digest)  # the calibration text reaches the stage through the store, by digest
    ingest = ingest_stage.node(open_source(model_dir), model_dir, tmp_path / "hashes.json")
    quantize = Node(
        "quantize/w4a16-gptq",
        quantize_stage.STAGE,
        params={
            "scheme": get_scheme("w4a16-gptq").model_dump(mode="json"),
            # float32: the path CPUs without native bf16 take (this one has it)
            "calibration": {"samples": 4, "seq_len": 64, "skip_tokens": 0, "compute_dtype": "float32"},
        },
        inputs={"ingest": ingest.id},
        external={"calibration_text": digest},
    )
    out = LocalExecutor(work).run([ingest, quantize])["quantize/w4a16-gptq"].output
    assert out is not None and (out.files_dir / "quantized.safetensors").is_file()
    assert out.record(QuantizeRecord).calibration == {
        "samples": 4,
        "seq_len": 64,
        "skip_tokens": 0,
        "compute_dtype": "float32",
    }
    assert not [p for p in work.root.rglob("*") if "calibration-offload" in p.name or p.name.startswith(".tmp-")]


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [(AVX2_ONLY, "float32"), (SAPPHIRE_RAPIDS, "bfloat16"), (GRAVITON3, "bfloat16"), ("", "float32")],
)
def test_calibration_computes_in_bf16_only_where_the_cpu_has_it(
    cpuinfo: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KILN_CALIBRATION_DTYPE", raising=False)
    assert calibration_dtype(cpuinfo) == dtype
    monkeypatch.setenv("KILN_CALIBRATION_DTYPE", "float32")
    assert calibration_dtype(SAPPHIRE_RAPIDS) == "float32"
    monkeypatch.setenv("KILN_CALIBRATION_DTYPE", "float16")
    with pytest.raises(InvalidInput, match="KILN_CALIBRATION_DTYPE"):
        calibration_dtype(cpuinfo)


def test_gptq_single_hessian_matches_upstream_functions() -> None:
    """`gptq_single_hessian`'s `prepare_batch` (a batch of one) and activation ordering work in the Hessian's
    own memory and give exactly what llm-compressor's functions give; end to end, `calibrate` (patched)
    equals plain `oneshot` (test_disk_offloaded_calibration_equals_oneshot_on_the_model_in_memory)."""
    import torch
    from compressed_tensors.quantization.quant_args import ActivationOrdering
    from llmcompressor.modifiers.gptq import base, gptq_quantize, helpers

    from kiln.quant.calibrated import gptq_single_hessian

    g = torch.Generator().manual_seed(0)
    rows, cols = 48, 320  # several cycles in the permutation
    module = torch.nn.Linear(cols, rows, bias=False).to(torch.bfloat16)
    x = torch.randn(cols, 3 * cols, generator=g)
    hessian = x @ x.T * 2.0
    hessian[5, 7] += 1.0  # not symmetric: permuting rows for columns would show
    qparams = {"scale": torch.rand(rows, cols // 32, generator=g), "zero_point": torch.zeros(rows, cols // 32)}

    def run(prepare, order, h: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        with torch.no_grad():  # as GPTQModifier.compress_module_list calls them
            batch = prepare([module], [{**qparams, "global_scale": None}], {module: h}, {module: torch.tensor(6.0)})
            weights, hessians, scales, zero_points, global_scales = batch
            assert global_scales is None
            return (scales, zero_points, *order(weights, hessians, ActivationOrdering.STATIC))

    upstream = run(helpers.prepare_batch, helpers.apply_activation_ordering, hessian.clone())
    mine = hessian.clone()
    with gptq_single_hessian():
        assert base.prepare_batch is not helpers.prepare_batch
        lean = run(base.prepare_batch, gptq_quantize.apply_activation_ordering, mine)
        assert gptq_quantize.apply_activation_ordering(lean[2], lean[3], None)[2] is None  # no ordering: untouched
    assert base.prepare_batch is helpers.prepare_batch  # restored
    assert gptq_quantize.apply_activation_ordering is helpers.apply_activation_ordering
    assert lean[3].data_ptr() == mine.data_ptr()  # no copy of the Hessian was made
    assert len(lean) == len(upstream)
    for a, b in zip(lean, upstream, strict=True):
        assert torch.equal(a, b)


def _tied_qwen2(root: Path) -> Path:
    return make_model(root, "qwen2", tie_word_embeddings=True, hidden_size=128, vocab_size=384)


def test_upstream_untie_still_breaks_a_disk_offloaded_tied_head(tmp_path: Path) -> None:
    """The reason for `untie_offloaded_head`: llm-compressor 0.14 unties a tied head (whenever a modifier's targets
    take in an embedding) by deleting and re-registering each weight, and on a disk-offloaded model the shared
    weight's offload entry goes with the first, so the head's cannot be read. Untied by kiln first, there is
    nothing left to break, and the head reads the embedding's values (from the source's file: nothing copied)."""
    import torch
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor.utils import untie_word_embeddings
    from transformers import AutoModelForCausalLM

    from kiln.quant.calibrated import untie_offloaded_head

    source = _tied_qwen2(tmp_path / "qwen2")

    def load(folder: str) -> torch.nn.Module:
        (tmp_path / folder).mkdir()
        with load_offloaded_model(AutoModelForCausalLM):
            return AutoModelForCausalLM.from_pretrained(
                str(source), dtype=torch.bfloat16, device_map={"": "disk"}, offload_folder=str(tmp_path / folder)
            )

    upstream = load("upstream")
    with pytest.raises(KeyError):  # `KeyError: Parameter containing: tensor(..., device='meta', ...)`
        untie_word_embeddings(upstream)

    model = load("kiln")
    files = sorted(p.name for p in (tmp_path / "kiln").iterdir())
    assert untie_offloaded_head(model) and not untie_offloaded_head(model)  # tied once, then no more
    assert model.config.tie_word_embeddings is False
    assert len(list((tmp_path / "kiln").iterdir())) == len(files) + 1  # one link more, no data written
    embedding = model.get_input_embeddings().weight.detach().clone()
    untie_word_embeddings(model)
    assert torch.equal(model.get_output_embeddings().weight, embedding)
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_a_quantize_stage_that_fails_says_what_failed_and_keeps_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure a tied head once met in `fp8-kv8` (llm-compressor's untie on disk-offloaded weights), restored:
    the STAGE_FAILED message names the stage, the error, the library's frame and kiln's call into it, where the
    traceback is, and what to try; the kept log ends with the traceback."""
    from kiln.core.errors import StageFailed
    from kiln.pipeline.executors.local import LocalExecutor
    from kiln.pipeline.stage import Node
    from kiln.pipeline.stages import ingest as ingest_stage
    from kiln.pipeline.stages import quantize as quantize_stage
    from kiln.pipeline.store import WorkDir
    from kiln.quant import calibrated

    recipe = calibrated._recipe
    monkeypatch.setattr(calibrated, "untie_offloaded_head", lambda model: False)
    monkeypatch.setattr(calibrated, "_recipe", lambda scheme, ignore=None, awq_mappings=None: recipe(scheme, []))
    source = _tied_qwen2(tmp_path / "qwen2")
    text = tmp_path / "calibration.txt"
    text.write_text(_stdlib_text("argparse.py"), encoding="utf-8")
    work = WorkDir(tmp_path / "work")
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    work.put_external(text, digest)
    ingest = ingest_stage.node(open_source(source), source, tmp_path / "hashes.json")
    quantize = Node(
        "quantize/fp8-kv8",
        quantize_stage.STAGE,
        params={
            "scheme": get_scheme("fp8-kv8").model_dump(mode="json"),
            "calibration": {"samples": 2, "seq_len": 32, "skip_tokens": 0, "compute_dtype": "float32"},
        },
        inputs={"ingest": ingest.id},
        external={"calibration_text": digest},
    )
    with pytest.raises(StageFailed) as failed:
        LocalExecutor(work).run([ingest, quantize])
    e = failed.value
    assert e.code == "STAGE_FAILED" and e.message.startswith(
        "quantize/fp8-kv8 failed: KeyError: Parameter containing: tensor(..., device='meta'"
    ), e.message
    assert e.details["raised_at"].startswith("compressed_tensors/offload/cache/disk.py:")
    assert ", from quant/calibrated.py:" in e.details["raised_at"] and e.details["raised_at"] in e.message
    assert f"its traceback is in {e.details['log']}" in e.message
    assert "To try: without fp8-kv8 in the recipe's targets, its other quants build" in e.message
    assert "`kiln run-stage RECIPE quantize/fp8-kv8`" in e.message
    log = Path(e.details["log"]).read_text()
    assert "Traceback (most recent call last)" in log and "in untie_word_embeddings" in log
    assert "KeyError: Parameter containing:" in log.split("Traceback (most recent call last)")[-1]
    assert not [line for line in e.details["log_tail"] if "Traceback" in line]  # the tail: what was printed before
