"""Shared fixtures for the eval tests: one random Llama model, its held-out text and the reference."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.eval.runtimes import CachedRuntime, TransformersRuntime
from kiln.eval.runtimes.environments import Environment, Installed, InstallRecord
from kiln.eval.text import EvalText, tokenize_text
from tests.model_factory import make_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama made confident: a freshly initialised model predicts almost uniformly, so even a
    broken conversion would barely move KL. Scaling lm_head and q/k gives peaked next-token
    distributions and position-dependent attention, which is what a wrong rope layout disturbs."""
    import torch
    from safetensors.torch import load_file, save_file

    out = make_model(tmp_path_factory.mktemp("eval-model") / "llama", "llama")
    path = out / "model.safetensors"
    scale = {"lm_head.weight": 30.0, "q_proj.weight": 10.0, "k_proj.weight": 10.0}
    weights = load_file(path)
    for name, t in weights.items():
        factor = next((s for suffix, s in scale.items() if name.endswith(suffix)), 1.0)
        weights[name] = (t.float() * factor).to(torch.bfloat16).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def heldout_text() -> str:
    # Real code and prose the tokenizer was not trained on (it was trained on other stdlib files).
    return (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def eval_text(llama_dir: Path, heldout_text: str) -> EvalText:
    return tokenize_text(
        llama_dir, heldout_text, window=128, max_tokens=1024, prompts=4, prompt_tokens=16, greedy_tokens=16
    )


@pytest.fixture(scope="session")
def reference(llama_dir: Path) -> Iterator[CachedRuntime]:
    rt = CachedRuntime(TransformersRuntime(llama_dir))
    yield rt
    rt.close()


def installed(env: Environment, path: Path, version: str = "0.32.0") -> Installed:
    """`env` as if installed at `path`, its check having printed `version`."""
    return Installed(env, path, InstallRecord.of(env, version, 0, 0.0))
