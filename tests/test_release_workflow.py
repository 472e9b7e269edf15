""".github/workflows/model-release.yml, run here as its jobs would run: plan, then each level's stages as
separate jobs (each `kiln run-stage` in its own empty work directory, sharing nothing but the S3 stage
store), then publish and promote against a running registry. The workflow file is read first, so the
commands run here are the ones it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml

from tests.registry.s3_server import S3Server, free_port

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "model-release.yml"
KILN = [sys.executable, "-m", "kiln"]
LEVELS = 4

pytestmark = pytest.mark.slow

RECIPE = """\
model: tiny-llama
version: 2.0.0
source: {model}
eval: {{text: heldout.txt, max_tokens: 512, window: 128, greedy_prompts: 2, greedy_tokens: 8}}
targets:
  - target: gguf
    quants: [q8_0]
  - target: hf-bundle
    quants: [int8-w8a8]
  - target: trtllm
    quants: [bf16]
    params:
      gpus: {{skus: [h100]}}
runners:
  cpu: [ubuntu-latest]
"""


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[2:6])} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def test_the_workflow_is_plan_stage_levels_publish_and_a_protected_promotion() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    jobs = flow["jobs"]
    levels = [f"level{i}" for i in range(LEVELS)]
    assert list(jobs) == ["plan", *levels, "publish", "promote"]
    assert "--levels 4" in jobs["plan"]["steps"][-1]["run"] and "--github-output" in jobs["plan"]["steps"][-1]["run"]
    for i, name in enumerate(levels):
        job = jobs[name]
        assert job["needs"] == ("plan" if i == 0 else ["plan", levels[i - 1]])
        assert job["runs-on"] == "${{ matrix.runs_on }}"
        assert job["strategy"]["matrix"] == f"${{{{ fromJSON(needs.plan.outputs.{name}) }}}}"
        assert job["steps"][-1]["run"] == '.venv/bin/kiln run-stage "$RECIPE" "$STAGE" --json'
    assert jobs["publish"]["steps"][-1]["run"] == '.venv/bin/kiln publish "$RECIPE" --json'
    assert jobs["promote"]["environment"] == "production" and jobs["promote"]["needs"] == ["plan", "publish"]
    assert jobs["promote"]["steps"][-1]["run"] == 'kiln promote "$RELEASE" --channel prod'


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A running `kiln serve` (reads need a token) and tokens with the publish and the promote scope."""
    data = tmp_path / "registry"
    data.mkdir()
    env = {**os.environ, "KILN_REGISTRY_DATA_DIR": str(data), "KILN_REGISTRY_ANONYMOUS_READ": "false"}
    run([*KILN, "db", "upgrade"], env)
    tokens = {
        scope: run(
            [*KILN, "token", "create", f"ci-{scope}", "--scopes", scope, "--registry", str(data)], env
        ).stdout.strip()
        for scope in ("publish", "promote", "read")
    }
    port = free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen([*KILN, "serve", "--port", str(port)], env=env, cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.2)
        yield url, tokens
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_the_release_runs_job_by_job_through_the_store(
    s3_server: S3Server, registry: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, tokens = registry
    (tmp_path / "heldout.txt").write_text((ROOT / "examples/tiny-llama/heldout.txt").read_text())
    recipe = tmp_path / "kiln.yaml"
    recipe.write_text(RECIPE.format(model=ROOT / "examples/tiny-llama/model"))
    store = s3_server.new_url()
    base = {
        **os.environ,
        "KILN_STORE": store,
        "KILN_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "KILN_ALLOW_OUTSIDE": str(ROOT / "examples/tiny-llama"),
    }

    def job(name: str, **extra: str) -> dict[str, str]:
        """A job's environment: its own empty work directory, the store, the registry."""
        return {**base, "KILN_WORK_DIR": str(tmp_path / "jobs" / name / "work"), **extra}

    outputs = tmp_path / "github_output"
    run([*KILN, "plan", str(recipe), "--matrix", "--levels", str(LEVELS), "--github-output", str(outputs)], job("plan"))
    values = dict(line.split("=", 1) for line in outputs.read_text().splitlines())
    assert (values["model"], values["version"]) == ("tiny-llama", "2.0.0")
    levels = [json.loads(values[f"level{i}"])["include"] for i in range(LEVELS)]

    ran: dict[str, str] = {}
    for level in levels:
        for entry in level:  # each a job: a clean machine with the labels its stage needs
            stage = entry["stage"]
            done = json.loads(
                run([*KILN, "run-stage", str(recipe), stage, "--json"], job(stage.replace("/", "-"))).stdout
            )
            ran[stage] = done["status"]
            if entry["runs_on"] == ["ubuntu-latest"]:
                assert done["status"] == "built", done
            else:  # a self-hosted GPU runner's stage: no H100 and no tensorrt_llm on this machine
                assert entry["runs_on"] == ["self-hosted", "gpu", "h100"] and done["status"] == "deferred", done
    assert ran["gpu-eval/trtllm-bf16@h100"] == "deferred" and ran["eval/gguf-q8_0"] == "built"
    assert not list((tmp_path / "jobs").glob("*/work/nodes"))  # no job read another's disk

    published = run(
        [*KILN, "publish", str(recipe), "--json"], job("publish", KILN_REGISTRY=url, KILN_TOKEN=tokens["publish"])
    )
    report = json.loads(published.stdout)
    assert report["stages"]["cached"] == sum(1 for s in ran.values() if s == "built")  # all from the store
    assert report["stages"]["ran"] == 4 and not report["failed_gates"]  # 3 publishes and the seal

    run(
        [*KILN, "promote", "tiny-llama@2.0.0", "--channel", "prod"],
        job("promote", KILN_REGISTRY=url, KILN_TOKEN=tokens["promote"]),
    )
    resolved = run(
        [*KILN, "resolve", "tiny-llama", "--hardware", "cpu", "--json"],
        job("router", KILN_REGISTRY=url, KILN_TOKEN=tokens["read"]),
    )
    assert json.loads(resolved.stdout)["version"] == "2.0.0"
