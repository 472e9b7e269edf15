"""One table of runtime facts: every runtime a target or a runner stage names has its row, opened by what the
row names, and planned from the same row."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import Deferred
from kiln.eval.runtimes import open_runtime
from kiln.eval.runtimes.environments import ENVIRONMENTS
from kiln.eval.runtimes.facts import RUNTIME_FACTS
from kiln.eval.runtimes.layer_stream import open_transformers
from kiln.formats.hf_model import open_shape
from kiln.pipeline.requirements import Sizing, eval_requirements, runner_requirements
from kiln.targets.base import all_targets
from kiln.targets.trtllm.stages import GPU_EVAL, LEGACY_ENGINE

EXAMPLE_MODEL = Path(__file__).parents[2] / "examples" / "tiny-llama" / "model"


def test_every_runtime_a_target_names_has_its_facts() -> None:
    named = {
        runtime
        for spec in all_targets().values()
        for quant in spec.quants
        for runtime in (spec.runtime, *spec.serving_runtimes, *spec.runtimes_for(quant))
    }
    named |= {GPU_EVAL.runtime, LEGACY_ENGINE.runtime}
    named |= {env.serves for env in ENVIRONMENTS.values()}
    assert named <= set(RUNTIME_FACTS), named - set(RUNTIME_FACTS)


def test_each_row_is_opened_by_the_runtime_of_its_name() -> None:
    for name, facts in RUNTIME_FACTS.items():
        assert facts.name == name
        # A class is the runtime itself; a function (transformers: streamed or whole) opens one of them.
        assert getattr(facts.opener, "name", name) == name
    assert RUNTIME_FACTS["transformers"].opener is open_transformers


def test_a_runtime_without_facts_is_not_evaluated_here(tmp_path: Path) -> None:
    with pytest.raises(Deferred) as e:
        open_runtime("no-such-runtime", tmp_path)
    assert e.value.details["runtime_needed"] == "no-such-runtime"


@pytest.mark.parametrize("runtime", sorted(RUNTIME_FACTS))
def test_the_planner_sizes_every_runtime_from_its_facts(runtime: str) -> None:
    config, shape = open_shape(EXAMPLE_MODEL)
    sizing = Sizing.of_config(config, shape, max_tokens=512, window=128, greedy_tokens=8)
    facts = RUNTIME_FACTS[runtime]
    req = eval_requirements(sizing, runtime, "bf16", device="cuda" if facts.on_stage_device else "cpu")
    assert req.memory_bytes > 0
    if facts.vendor is not None:  # a runner's runtime: here the eval records "not evaluated", on the CPU
        assert req.gpus == 0 and req.runtime_env is None
        # A stage on its runner asks for a GPU of that vendor, with the runtime's environment pinned.
        runner = runner_requirements(sizing, runtime, "bf16", "h100", "1.2.3")
        assert runner.accelerator == f"{facts.vendor}:h100" and runner.runtime_env == f"{facts.runtime_env}==1.2.3"
