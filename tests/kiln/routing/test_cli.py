"""`kiln routing render` as a person or a CI job runs it: against a registry server on a loopback port with a
read token, YAML to a file or to standard output, and each bad input a stable code and exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.kiln.routing.kube_schema import assert_valid
from tests.registry.conftest import make_token
from tests.registry.helpers import serve_in_thread

ROOT = Path(__file__).resolve().parents[3]


def kiln(*args: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KILN_TOKEN": token, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_render_writes_valid_yaml_and_refuses_bad_input_with_codes(
    app: FastAPI, fleet: TestClient, tmp_path: Path
) -> None:
    assert fleet.put(
        "/v1/models/llama/channels/prod/split",
        json={"weights": [{"version": "1.4.0", "weight": 95}, {"version": "1.5.0", "weight": 5}]},
    ).is_success
    reader = make_token(app, ["read"], models=["llama"], name="router")
    with serve_in_thread(app) as port:
        registry = f"http://127.0.0.1:{port}"
        common = ["--registry", registry, "--pool", "h100:8", "--pool", "mi300x:8", "--context", "32768"]
        out = tmp_path / "deploy" / "llama-prod.yaml"
        done = kiln("routing", "render", "llama", "--format", "kserve", *common, "--out", str(out), token=reader)
        assert done.returncode == 0, done.stderr
        assert done.stdout == ""
        assert "6 objects for llama channel prod (1.4.0 95 %, 1.5.0 5 %)" in " ".join(done.stderr.split())
        text = out.read_text()
        documents = list(yaml.safe_load_all(text))
        assert [d["kind"] for d in documents] == ["InferenceService"] * 2 + ["InferenceGraph"] + (
            ["InferenceService"] * 2 + ["InferenceGraph"]
        )
        for document in documents:
            assert_valid(document)
        assert f"oci://127.0.0.1:{port}/modelcar/llama:1.5.0-rocm-bundle-bf16" in text
        assert [p.name for p in out.parent.iterdir()] == ["llama-prod.yaml"]  # no temporary file left
        printed = kiln("routing", "render", "llama", "--format", "kserve", *common, token=reader)
        assert printed.returncode == 0 and printed.stdout == text

        for args, status, code in (
            (["--format", "istio", *common], 2, "ROUTING_FORMAT_UNKNOWN"),
            (["--format", "gateway-api", "--registry", registry], 2, "ROUTING_NO_POOLS"),
            (["--format", "gateway-api", "--registry", registry, "--pool", "h100,mi300x"], 2, "ROUTING_POOL_INVALID"),
            (["--format", "gateway-api", "--registry", registry, "--pool", "tpu-v5e:8"], 4, "NO_COMPATIBLE_ARTIFACT"),
            (["--format", "kserve", "--channel", "staging", *common], 4, "ROUTING_CHANNEL_EMPTY"),
            (["--format", "kserve", "--namespace", "Prod", *common], 2, "ROUTING_OPTION_INVALID"),
        ):
            failed = kiln("routing", "render", "llama", *args, token=reader)
            assert (failed.returncode, failed.stdout) == (status, ""), (args, failed.stderr)
            assert f"[{code}]" in failed.stderr, (args, failed.stderr)
        # A token for another model reads nothing of this one.
        other = make_token(app, ["read"], models=["other"], name="other-router")
        denied = kiln("routing", "render", "llama", "--format", "gateway-api", *common, token=other)
        assert denied.returncode == 6 and "[FORBIDDEN]" in denied.stderr
