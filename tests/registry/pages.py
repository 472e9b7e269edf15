"""For the web page tests: a release worth looking at, and a small HTML tree to assert on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.registry.helpers import make_release, post_eval, promote, publish, publish_declared, seal

DESCRIPTION = "Tiny test model <script>alert('description')</script>"
FORCED_REASON = "<script>alert('reason')</script> ship despite the q4_0 regression"
YANK_REASON = "<b>broken</b> tokenizer"
FILES = {
    "gguf-q8_0": {"model-q8_0.gguf": b"q8" * 400},
    "gguf-q4_0": {"model-q4_0.gguf": b"q4" * 300},
    "trtllm-fp8": {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": b"fp8" * 900},
    "hf-bundle-bf16": {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"bf" * 2000},
}
LOSSLESS_GATE = {"max_kl": 0.005, "min_top1": 0.95, "max_ppl_increase": 0.01, "min_greedy_match": None}
ROUNDED_GATE = {"max_kl": 0.15, "min_top1": 0.8, "max_ppl_increase": 0.15, "min_greedy_match": None}
FAILURES = "kl 0.31 is above max_kl 0.15; ppl_change 0.21 is above max_ppl_increase 0.15"
LLAMA_CPP = "llama-cpp-python 0.3.36"
OLD_LLAMA_CPP = "llama-cpp-python 0.3.35"
TRANSFORMERS = "transformers 5.17.0, torch 2.13.0"
VLLM = "vLLM 0.32.0 (CPU)"
SOURCE_SHA = "d" * 64
HOSTILE_LINEAGE = "<script>alert('lineage')</script>"
HOSTILE_HOST = "<b>runner</b>-7"
LINEAGE = {
    "source_files": [
        {"path": "model.safetensors", "sha256": SOURCE_SHA, "size": 3 * 1024**3},
        {"path": "config.json", "sha256": "e" * 64, "size": 612},
    ],
    "built_by": "kiln 0.1.0",
    "source": HOSTILE_LINEAGE,
    # Past the flattening depth, and a list of nested records: both shown as compact JSON.
    "recipe": {"options": {"deep": {"deeper": {"deepest": 1}}}},
    "steps": [{"name": "ingest", "args": {"revision": "main"}}],
}
PROVENANCE = {
    "stage": "export",
    "code_version": "3",
    "cache_key": "c" * 64,
    "host": HOSTILE_HOST,
    "started_at": "2026-11-24T10:00:00Z",
    "duration_s": 12.5,
    "kiln_version": "0.1.0",
    "python": "3.12.3",
    "params": {"quant": "q8_0", "targets": ["gguf", "hf-bundle"]},
    "inputs": {"model": {"node": "ingest", "digest": "f" * 64}},
}


def seed(client: TestClient) -> None:
    """tiny@1.0 (promoted to prod, then yanked), tiny@2.0 with four artifacts: one passed on llama.cpp
    (and not evaluated on llama.cpp-metal), one failed on two gates under another llama.cpp version, one
    passed on transformers and on vLLM side by side (KL 0 on transformers), one not evaluated here; 2.0
    has lineage with source files and one artifact has provenance, both with hostile strings, and was
    forced to prod over the failure; and tiny@3.0, open, with one of its two artifacts published,
    without an eval."""
    assert client.post("/v1/models", json={"name": "tiny", "description": DESCRIPTION}).status_code == 201
    make_release(client, version="1.0", planned=["gguf-q8_0"])
    publish(client, "gguf-q8_0", {"old-q8_0.gguf": b"old" * 100}, ["cpu"], version="1.0")
    assert post_eval(client, "gguf-q8_0", "passed", version="1.0").status_code == 201
    seal(client, "1.0")
    assert promote(client, "1.0", actor="alice").status_code == 200
    make_release(client, version="2.0", planned=list(FILES), lineage=LINEAGE)
    publish(client, "gguf-q8_0", FILES["gguf-q8_0"], ["cpu", "apple"], version="2.0", provenance=PROVENANCE)
    publish(client, "gguf-q4_0", FILES["gguf-q4_0"], ["cpu"], version="2.0", quant="q4_0")
    publish(
        client,
        "trtllm-fp8",
        FILES["trtllm-fp8"],
        ["h100", "h200"],
        version="2.0",
        quant="fp8",
        target="trtllm",
        format="hf-checkpoint",
        unsupported={"a100": "FP8 tensor cores need sm89+"},
        runtime={"tensorrt_llm": ">=0.21"},
    )
    publish(
        client,
        "hf-bundle-bf16",
        FILES["hf-bundle-bf16"],
        ["cpu", "sm80"],
        version="2.0",
        quant="bf16",
        target="hf-bundle",
        format="safetensors",
    )
    passed = {"ppl_change": 0.0004, "kl": 8.1e-5, "top1": 0.992, "greedy_match": 0.91, "ppl": 53.7}
    failed = {"ppl_change": 0.21, "kl": 0.31, "top1": 0.86, "greedy_match": 0.4, "ppl": 65.0}
    ok = post_eval(
        client, "gguf-q8_0", "passed", version="2.0", metrics=passed, gates=LOSSLESS_GATE, runtime_version=LLAMA_CPP
    )
    assert ok.status_code == 201
    bad = post_eval(
        client,
        "gguf-q4_0",
        "failed",
        version="2.0",
        metrics=failed,
        gates=ROUNDED_GATE,
        reason=FAILURES,
        runtime_version=OLD_LLAMA_CPP,
    )
    assert bad.status_code == 201
    not_here = "needs a runner with tensorrt_llm and an H100; this machine has neither"
    assert (
        post_eval(client, "trtllm-fp8", "not_evaluated", runtime="tensorrt_llm", version="2.0", reason=not_here)
    ).status_code == 201
    metal = "llama.cpp with Metal runs on an apple runner only"
    assert (
        post_eval(client, "gguf-q8_0", "not_evaluated", runtime="llama.cpp-metal", version="2.0", reason=metal)
    ).status_code == 201
    exact = {"ppl_change": 0.0, "kl": 0.0, "top1": 1.0, "greedy_match": 1.0}
    close = {"ppl_change": 0.0002, "kl": 3e-6, "top1": 0.998, "greedy_match": 0.97}
    for runtime, metrics, runtime_version in (("transformers", exact, TRANSFORMERS), ("vllm", close, VLLM)):
        done = post_eval(
            client,
            "hf-bundle-bf16",
            "passed",
            runtime=runtime,
            version="2.0",
            metrics=metrics,
            gates=LOSSLESS_GATE,
            runtime_version=runtime_version,
        )
        assert done.status_code == 201, done.text
    seal(client, "2.0")
    forced = promote(client, "2.0", force=True, reason=FORCED_REASON, actor="release-bot")
    assert forced.status_code == 200, forced.text
    assert client.post("/v1/models/tiny/releases/1.0/yank", json={"reason": YANK_REASON}).status_code == 200
    make_release(client, version="3.0", planned=["gguf-q4_0", "gguf-q8_0"])
    publish(client, "gguf-q8_0", {"new-q8_0.gguf": b"new" * 100}, ["cpu"], version="3.0")


# A fleet worth fitting: Llama-3-70B's real config (examples/llama-3-70b) in the bundles kiln builds for GPUs and
# the GGUFs llama.cpp serves on CPU. The bundles' bytes are `quant.footprint.checkpoint_bytes` of that config; the
# GGUFs' are its 70,553,706,496 parameters at llama.cpp's bits per weight: 8.5 for Q8_0 (34 bytes per block of 32),
# and about 4.85 and 3.0 for the Q4_K_M and Q2_K mixes. Only the sizes matter: the blobs are declared, not stored.
FLEET_MODEL = "llama-3-70b"
LLAMA_70B: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[2] / "examples/llama-3-70b/config.json").read_text()
)
PARAMETERS_70B = 70_553_706_496
FLEET: dict[str, tuple[int, list[str], str, str, str, float]] = {
    # name: (bytes, hardware, quant, target, eval runtime, KL)
    "hf-bf16": (141_107_412_992, ["h100", "mi300x"], "bf16", "hf-bundle", "vllm", 0.0),
    "hf-fp8": (72_669_806_592, ["h100"], "fp8", "hf-bundle", "vllm", 0.011),
    "hf-w4a16-awq": (39_500_407_552, ["h100", "mi300x"], "w4a16-awq", "hf-bundle", "vllm", 0.042),
    "gguf-q8_0": (PARAMETERS_70B * 34 // 32, ["cpu"], "q8_0", "gguf", "llama.cpp", 0.004),
    "gguf-q4_k_m": (PARAMETERS_70B * 485 // 800, ["cpu"], "q4_k_m", "gguf", "llama.cpp", 0.061),
    "gguf-q2_k": (PARAMETERS_70B * 3 // 8, ["cpu"], "q2_k", "gguf", "llama.cpp", 0.48),
}
FLEET_GATE = {"max_kl": 0.1}
# hf-fp8 measured on two H100s at 8K × 4: a little under its bound (about 68 tokens/s per sequence).
FP8_RECORD: dict[str, Any] = {
    "hardware": "h100",
    "runtime": "vllm",
    "runtime_version": "vLLM 0.32.0, CUDA 12.8",
    "tp": 2,
    "context": 8192,
    "concurrency": 4,
    "tokens_per_s": 221.0,
    "ttft_ms": 612.0,
    "itl_p50_ms": 17.6,
    "itl_p99_ms": 24.9,
}


def seed_fleet(app: FastAPI, client: TestClient) -> None:
    """llama-3-70b@1.0, sealed and on prod: FLEET's artifacts, each evaluated against FLEET_GATE (gguf-q2_k fails
    it), and FP8_RECORD, hf-fp8's measured speed on two H100s at 8K × 4."""
    make_release(client, model=FLEET_MODEL, model_config=LLAMA_70B, planned=list(FLEET))
    for name, (size, hardware, quant, target, runtime, kl) in FLEET.items():
        fmt = "gguf-v3" if target == "gguf" else "safetensors"
        publish_declared(client, app, name, size, hardware, model=FLEET_MODEL, quant=quant, target=target, format=fmt)
        status = "passed" if kl <= FLEET_GATE["max_kl"] else "failed"
        reason = None if status == "passed" else f"kl {kl} is above max_kl {FLEET_GATE['max_kl']}"
        done = post_eval(
            client,
            name,
            status,
            runtime=runtime,
            model=FLEET_MODEL,
            metrics={"kl": kl},
            gates=FLEET_GATE,
            reason=reason,
        )
        assert done.status_code == 201, done.text
    measured = client.post(f"/v1/models/{FLEET_MODEL}/releases/1.0/artifacts/hf-fp8/performance", json=FP8_RECORD)
    assert measured.status_code == 201, measured.text
    seal(client, model=FLEET_MODEL)
    assert promote(client, model=FLEET_MODEL, force=True, reason="gguf-q2_k is not served").status_code == 200


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Node:
    """An element: tag, attributes and children (nodes and text)."""

    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The text inside, whitespace collapsed."""
        parts: list[str] = []

        def walk(node: Node) -> None:
            for child in node.children:
                if isinstance(child, str):
                    parts.append(child)
                else:
                    walk(child)

        walk(self)
        return " ".join(" ".join(parts).split())

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find_all(self, tag: str, **attrs: str) -> list[Node]:
        """Descendants (self included) with this tag and attributes (`class_` matches one class)."""
        wanted_class = attrs.pop("class_", None)
        return [
            n
            for n in self.iter()
            if n.tag == tag
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
            and (wanted_class is None or wanted_class in n.classes)
        ]

    def find(self, tag: str, **attrs: str) -> Node:
        found = self.find_all(tag, **attrs)
        assert len(found) == 1, f"expected one <{tag} {attrs}>, found {len(found)}"
        return found[0]


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Node:
    """The document as a tree of Nodes (text unescaped, as a browser shows it)."""
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root
