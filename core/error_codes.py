"""Every error code kiln reports, in one catalog: what it means, its CLI exit status and its HTTP status.

A code is declared once, as an attribute of `Codes` naming its kind and meaning; a raise names it
(`InvalidInput(..., code=Codes.QUANT_SHAPE)`), and `KilnError` refuses a code the catalog does not list,
or lists for another kind of error. The kind fixes the exit status and, unless the code gives its own,
the HTTP status; the CLI (`kiln.cli`) and the API (`registry.api.errors`) read both from here, and
docs/cli.md and docs/registry.md print the tables `markdown` renders (`python -m kiln.core.error_codes --write-docs`).
Codes are stable: a client may match on them, so one is never renamed or given another meaning.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType


class Kind(Enum):
    """What sort of failure a code reports; the error class that raises it says the same (`KilnError.kind`)."""

    FAILED = ("failure", 1, 500)
    INVALID = ("bad input", 2, 422)
    GATE_FAILED = ("an eval gate failed", 3, 409)
    NOT_FOUND = ("not found", 4, 404)
    CONFLICT = ("conflict with what is stored", 5, 409)
    UNAUTHORIZED = ("not allowed", 6, 401)
    FORBIDDEN = ("not allowed", 6, 403)
    UNAVAILABLE = ("a backend is unavailable", 7, 503)

    what: str
    exit_status: int
    http_status: int

    def __init__(self, what: str, exit_status: int, http_status: int) -> None:
        self.what = what
        self.exit_status = exit_status
        self.http_status = http_status


@dataclass(frozen=True)
class ErrorCode:
    """One entry: the code, the kinds of error that carry it (the first the usual one), what it means, and
    its HTTP status where that is not its kind's (`http`; `http_varies`: the web framework's own)."""

    code: str
    kinds: tuple[Kind, ...]
    meaning: str
    http: int | None = None
    http_varies: bool = False

    def http_status(self, kind: Kind | None = None) -> int:
        return self.http if self.http is not None else (kind or self.kinds[0]).http_status

    def exit_status(self, kind: Kind | None = None) -> int:
        return (kind or self.kinds[0]).exit_status


_CATALOG: dict[str, ErrorCode] = {}
CATALOG: Mapping[str, ErrorCode] = MappingProxyType(_CATALOG)


class Code:
    """A catalog entry declared in `Codes`: the attribute's name is the code, and reading it gives that string."""

    def __init__(
        self,
        kind: Kind,
        meaning: str,
        *,
        also: tuple[Kind, ...] = (),
        http: int | None = None,
        http_varies: bool = False,
    ) -> None:
        self._args = (kind, also, meaning, http, http_varies)
        self.code = ""

    def __set_name__(self, owner: type, name: str) -> None:
        kind, also, meaning, http, http_varies = self._args
        if name in _CATALOG:
            raise ValueError(f"error code {name} is declared twice")
        self.code = name
        _CATALOG[name] = ErrorCode(name, (kind, *also), meaning, http, http_varies)

    def __get__(self, instance: object, owner: type | None = None) -> str:
        return self.code


class Codes:
    """Every code, to raise with: `code=Codes.NAME`. Grouped by where they are raised."""

    # The hierarchy's own (core.errors): what an error of the class carries when it names no other code.
    KILN_ERROR = Code(Kind.FAILED, "a failure with no more specific code")
    INVALID_INPUT = Code(Kind.INVALID, "the request, arguments or a file are malformed; the message says what")
    NOT_FOUND = Code(Kind.NOT_FOUND, "no such model, release, artifact, channel or route")
    CONFLICT = Code(Kind.CONFLICT, "the request contradicts what is stored; nothing was changed")
    EVAL_GATE_FAILED = Code(Kind.GATE_FAILED, "an artifact's eval missed its recipe's gate")
    UNAUTHORIZED = Code(Kind.UNAUTHORIZED, "no token, or one the registry does not accept")
    FORBIDDEN = Code(Kind.FORBIDDEN, "the token lacks the scope, or the model pattern, the request needs")
    UNAVAILABLE = Code(Kind.UNAVAILABLE, "a backend (database, blob store) cannot be reached now; try again")
    STAGE_FAILED = Code(Kind.FAILED, "a stage failed; its log, ending with the traceback, is named")
    DEFERRED = Code(Kind.FAILED, "the work needs hardware or software this machine lacks; a runner that has it does it")

    # Files, data and arguments given to kiln.
    RECIPE_INVALID = Code(Kind.INVALID, "the recipe fails its schema, or names what cannot be built together")
    DATA_FILE_INVALID = Code(
        Kind.INVALID, "a file given is not a regular UTF-8 YAML or JSON file holding plain JSON values"
    )
    INVALID_JSON = Code(Kind.INVALID, "text that is not JSON kiln accepts (duplicate keys, constants, too deep)")
    OUTPUT_PATH_INVALID = Code(Kind.INVALID, "a path to write to is not one a file can be written at")
    UNKNOWN_NAME = Code(
        Kind.INVALID, "a target, scheme or hardware name that is not registered; the known ones are listed"
    )
    UNSAFE_CHECKPOINT = Code(Kind.INVALID, "a pickle checkpoint or an unsafe path: refused, never loaded")
    DIGEST_MISMATCH = Code(Kind.INVALID, "bytes whose sha256 is not the one they were named by")
    INVALID_DEVICE = Code(Kind.INVALID, "a device that is not auto, cpu, cuda or cuda:N")
    DEVICE_UNAVAILABLE = Code(Kind.INVALID, "a device this machine (or Ray worker) does not have")
    INVALID_HOST_MEMORY = Code(Kind.INVALID, "KILN_HOST_MEMORY is not a number of bytes")
    UNKNOWN_EXECUTOR = Code(Kind.INVALID, "--executor is not local or ray")
    WORKFLOW_TOO_SHALLOW = Code(Kind.INVALID, "a CI workflow has fewer level jobs than the build graph has levels")
    TOKEN_EXPIRY_INVALID = Code(Kind.INVALID, "a token expiry that is not a future time with its zone (or a duration)")

    # Sources.
    SOURCE_INVALID = Code(
        Kind.INVALID,
        "the SafeTensors source is malformed (header, offsets, dtypes, config, shapes)",
        also=(Kind.FAILED,),
    )
    SOURCE_CHANGED = Code(Kind.INVALID, "a source file is not what the plan saw (changed or gone); plan again")
    SOURCE_NOT_FOUND = Code(Kind.NOT_FOUND, "the hub has no such repository or revision")
    SOURCE_UNAVAILABLE = Code(Kind.UNAVAILABLE, "the source's server (hub, S3) cannot be reached or failed")
    SOURCE_SHAPE_ONLY = Code(Kind.INVALID, "a build of a shape-only source (config.json, no weights)")
    SOURCE_QUANTIZATION_INVALID = Code(Kind.INVALID, "a pre-quantized source that is not its declared layout")
    SOURCE_STORED_QUANTIZED = Code(Kind.FAILED, "a stage read a pre-quantized weight as plain (an error in kiln)")
    INVALID_SOURCE_URL = Code(Kind.INVALID, "a source URL kiln cannot read (scheme, repository, revision)")

    # Building: the plan, executors and the stage store.
    BUILD_DISK_INSUFFICIENT = Code(
        Kind.INVALID, "the stages still to run would write more than the work dir's disk has"
    )
    GRAPH_ORDER = Code(Kind.FAILED, "a stage was run before its inputs (an error in kiln)")
    RAY_CLUSTER_EMPTY = Code(Kind.FAILED, "the Ray cluster has no live node")
    STAGE_WORKER_LOST = Code(Kind.FAILED, "a stage's Ray worker died on every retry")
    STAGE_INPUT_MISSING = Code(Kind.FAILED, "a stage's input is not in the stage store")
    STAGE_RECORD_CORRUPT = Code(Kind.FAILED, "a stage.json that does not match its key or its files")
    STAGE_STORE_CORRUPT = Code(Kind.FAILED, "the shared stage store holds a missing, oversized or unreadable record")
    STAGE_STORE_UNAVAILABLE = Code(Kind.UNAVAILABLE, "the shared stage store cannot be reached or failed")
    INVALID_STORE_URL = Code(Kind.INVALID, "--store is not an s3://bucket/prefix URL")

    # Quantization.
    QUANT_SHAPE = Code(
        Kind.INVALID, "a layer's shape does not fit the scheme (e.g. a width not a multiple of the group)"
    )
    QUANT_HEAD_TIED = Code(Kind.INVALID, "lm_head asked quantized for a model whose head is its embedding")
    QUANT_HEAD_UNSUPPORTED = Code(Kind.INVALID, "lm_head asked quantized for a scheme that quantizes nothing")
    QUANT_RELEASE_ONLY = Code(Kind.INVALID, "a release's own layout asked of a plain source")
    QUANT_SOURCE_REFUSED = Code(Kind.INVALID, "a method not built from a source released in this quantized layout")
    QUANT_UNSUPPORTED = Code(Kind.INVALID, "the target refuses this quant (for this model)")
    QUANTIZE_PLAN_MISMATCH = Code(Kind.FAILED, "quantizing gave a tensor of another dtype or shape than planned")
    CALIBRATION_TOO_SHORT = Code(Kind.INVALID, "the calibration text has fewer tokens than samples × seq_len")
    CALIBRATION_FAILED = Code(Kind.FAILED, "calibration failed or left a scale zero or not finite")

    # Targets.
    TARGET_ARCHITECTURE_UNSUPPORTED = Code(Kind.INVALID, "the target cannot serve this architecture")
    TARGET_PARAMS = Code(Kind.INVALID, "the recipe's params for a target are invalid")
    TARGET_NOT_REGISTERED = Code(Kind.FAILED, "a target module did not register what it must (an error in kiln)")
    TARGET_REGISTERED_TWICE = Code(Kind.FAILED, "two targets share a name (an error in kiln)")
    HARDWARE_INCOMPATIBLE = Code(Kind.FAILED, "the target and quant cannot serve the hardware the recipe names")
    GGUF_INVALID = Code(Kind.INVALID, "a GGUF file llama.cpp's reader refuses (header, metadata, tensor info)")
    GGUF_UNSUPPORTED = Code(Kind.INVALID, "the GGUF export cannot write this model as llama.cpp's architecture")
    GGUF_UNSUPPORTED_ARCH = Code(Kind.INVALID, "no llama.cpp architecture for this model, or its mapping is unusable")
    GGUF_NAME_UNSUPPORTED = Code(Kind.INVALID, "a model name for which llama.cpp would set token attributes wrongly")
    GGUF_TOKENIZER_UNSUPPORTED = Code(Kind.INVALID, "a tokenizer the GGUF export cannot convert")
    GGUF_VOCAB_MISMATCH = Code(Kind.INVALID, "the tokenizer has token ids past config.json's vocab_size")
    GGUF_F16_OVERFLOW = Code(Kind.INVALID, "a tensor with values F16 cannot hold; export bf16 or q8_0")
    GGUF_ROW_NOT_DIVISIBLE = Code(Kind.INVALID, "a tensor's rows are not a multiple of the GGUF type's block")
    GGUF_QUANTIZE_FAILED = Code(Kind.FAILED, "llama.cpp's quantizer failed")
    GGUF_SIZE_MISMATCH = Code(Kind.FAILED, "the GGUF written is not the size its plan says")
    GGUF_WRITER_STATE = Code(Kind.FAILED, "a GGUF writer used in the wrong order (an error in kiln)")
    WRITER_MISUSE = Code(Kind.FAILED, "a SafeTensors writer used in the wrong order (an error in kiln)")
    ENGINE_UNSUPPORTED = Code(Kind.INVALID, "no TensorRT-LLM engine build for this model or quant")
    ENGINE_SKU_INCOMPATIBLE = Code(Kind.INVALID, "the TensorRT-LLM quant cannot run on a GPU the recipe names")
    TENSORRT_LLM_TOO_OLD = Code(Kind.INVALID, "the TensorRT-LLM version named cannot load this checkpoint")
    TRTLLM_CHECKPOINT = Code(Kind.INVALID, "the model cannot be written as a TensorRT-LLM checkpoint (config, tensors)")
    TRTLLM_QUANT_CONFIG = Code(Kind.INVALID, "a quantization config TensorRT-LLM has no QuantAlgo for")
    TRTLLM_RELEASE_LAYOUT = Code(Kind.INVALID, "TensorRT-LLM's model class reads no checkpoint in the source's layout")
    TRTLLM_FUSED_SCALES = Code(Kind.FAILED, "Linears TensorRT-LLM runs as one GEMM got different scales")
    ORBAX_UNSUPPORTED = Code(Kind.INVALID, "the orbax export cannot write this model")
    ORBAX_MESH_INVALID = Code(Kind.INVALID, "the recipe's mesh is not axis names to sizes with a model axis")
    ORBAX_SHARDING_NOT_DIVISIBLE = Code(Kind.INVALID, "a dimension the plan shards is not a multiple of the mesh axis")
    ORBAX_INT8_MISMATCH = Code(Kind.FAILED, "the quantize stage's output is not int8 values times per-channel scales")
    ORBAX_PLAN_MISMATCH = Code(Kind.FAILED, "a tensor written to the checkpoint is not the dtype or shape planned")
    ORBAX_WRITE_FAILED = Code(Kind.FAILED, "orbax left files beside the finished checkpoint")
    ORBAX_WRITER_MISUSE = Code(Kind.FAILED, "an orbax writer used in the wrong order (an error in kiln)")
    FP8_DTYPE = Code(Kind.INVALID, "FP8 weights of another float8 type than the conversion expects")
    FP8_NAN = Code(Kind.INVALID, "FP8 weights holding NaN (or values the other FP8 type cannot express)")
    BUNDLE_CONFIG_INVALID = Code(Kind.INVALID, "a bundle's config.json or quantization_config is malformed")
    LINT_NOT_AN_ARTIFACT = Code(Kind.INVALID, "a path kiln lint does not recognise as an artifact")
    LINT_UNSUPPORTED = Code(Kind.INVALID, "no lint for the target, or several: name one with --target")

    # Evaluation.
    EVAL_RUNTIME_LOAD_FAILED = Code(Kind.FAILED, "a runtime could not load the artifact or the reference model")
    EVAL_RUNTIME_FAILED = Code(Kind.FAILED, "a runtime failed while computing, or returned too little")
    EVAL_RUNTIME_DIED = Code(Kind.FAILED, "the runtime's worker exited, or cut its reply short")
    EVAL_RUNTIME_CLOSED = Code(Kind.FAILED, "the runtime was used after it was closed")
    EVAL_RUNTIME_PROTOCOL = Code(Kind.FAILED, "the runtime's worker speaks another protocol version")
    EVAL_CAPABILITY_MISMATCH = Code(Kind.FAILED, "the eval was planned for a machine whose runtime can do other things")
    EVAL_TEXT_INVALID = Code(Kind.INVALID, "the stored eval text is malformed or not its digest")
    REFERENCE_ARCHITECTURE_UNSUPPORTED = Code(Kind.FAILED, "the reference runtime cannot run this model as planned")
    REFERENCE_MISSING = Code(Kind.FAILED, "reference rows for these tokens were not recorded")
    REFERENCE_ROWS_CORRUPT = Code(Kind.INVALID, "stored reference rows are unreadable or inconsistent")
    KERNEL_UNAVAILABLE = Code(Kind.FAILED, "this torch or device has no kernel for the scheme's matmul")
    RUNTIME_INSTALL_FAILED = Code(Kind.FAILED, "installing a runtime environment failed; its log is named")
    RUNTIME_PROBE_TIMEOUT = Code(Kind.FAILED, "a runtime capability probe did not end in time")

    # Hardware and placement.
    HARDWARE_CATALOG_INVALID = Code(Kind.INVALID, "a hardware catalog entry or file fails its schema")
    HARDWARE_NOT_FOUND = Code(Kind.NOT_FOUND, "hardware the registry has no entry for")
    HARDWARE_NOT_IDENTIFIED = Code(Kind.INVALID, "no catalog entry names this device; name it with --hardware")
    PROBE_INCOMPLETE = Code(Kind.INVALID, "a probe run that is not a whole record, so not published")
    REPLICA_INPUT_INVALID = Code(Kind.INVALID, "a replica's size (devices, context, concurrency) is out of range")

    # Signing and attestations.
    SIGNATURE_INVALID = Code(Kind.INVALID, "a signature or provenance bundle that does not verify")
    ATTESTATION_SUBJECT_MISMATCH = Code(Kind.INVALID, "a verified statement whose files are not exactly the artifact's")
    ATTESTATION_CLAIM_MISMATCH = Code(Kind.INVALID, "a verified statement signed for another artifact")
    ATTESTATION_CLAIMS_MISSING = Code(Kind.INVALID, "a verified statement that names no artifact")
    KEY_INVALID = Code(Kind.INVALID, "a key that is not a PEM Ed25519 key kiln accepts")
    KEY_REVOKED = Code(
        Kind.INVALID,
        "a revoked key: what it signed is refused (422), and it is never trusted again (409)",
        also=(Kind.CONFLICT,),
    )
    NO_TRUSTED_KEY = Code(Kind.INVALID, "no publisher key is trusted for the model")
    FILE_IS_SYMLINK = Code(Kind.INVALID, "a file of a directory being verified is a symbolic link")
    NOT_A_REGULAR_FILE = Code(Kind.INVALID, "a file of a directory being verified is not a regular file")

    # The registry: models, releases, channels and resolve.
    ARTIFACT_NOT_PLANNED = Code(Kind.CONFLICT, "an artifact the release did not plan")
    ARTIFACT_UNSIGNED = Code(Kind.CONFLICT, "artifacts without a signature by a trusted key, where one is required")
    RELEASE_SEALED = Code(Kind.CONFLICT, "a sealed release's artifacts never change (and it is yanked, not abandoned)")
    RELEASE_ABANDONED = Code(Kind.CONFLICT, "the release was abandoned; publish a new version")
    RELEASE_NOT_SEALED = Code(
        Kind.CONFLICT, "the release is still open: only a sealed one is promoted, yanked or served"
    )
    RELEASE_INCOMPLETE = Code(Kind.CONFLICT, "a seal of a release missing planned artifacts or their evals")
    RELEASE_YANKED = Code(Kind.CONFLICT, "the release is yanked: it is not promoted and takes no performance records")
    RELEASE_NOT_SERVED = Code(Kind.NOT_FOUND, "the release is yanked or abandoned, so never served", http=410)
    CHANNEL_RELEASE_YANKED = Code(Kind.NOT_FOUND, "the channel points at a yanked release; promote another", http=410)
    VERSION_NOT_IN_CHANNEL = Code(Kind.NOT_FOUND, "the version asked for is not one the channel points at")
    NO_COMPATIBLE_ARTIFACT = Code(
        Kind.NOT_FOUND, "no artifact of the release serves, fits or passed its eval on this hardware"
    )
    SLO_UNMET = Code(Kind.NOT_FOUND, "no artifact meets the SLO asked for; the best one's misses are given")
    RESOLVE_KEY_AND_VERSION = Code(Kind.INVALID, "a resolve given both key and version")
    RESOLVE_POOLS_INVALID = Code(Kind.INVALID, "a resolve's hardware pools are malformed, repeated or too many")
    PAGE_CURSOR_UNKNOWN = Code(Kind.INVALID, "a page cursor naming a release the model does not have")
    PERFORMANCE_INVALID = Code(Kind.INVALID, "a performance record that contradicts itself or its artifact")

    # The registry: blobs, storage and the API's own limits.
    BLOB_MISSING = Code(Kind.INVALID, "a manifest names blobs not uploaded yet (or of another size)")
    BLOB_NOT_FOUND = Code(Kind.NOT_FOUND, "no blob of this digest is stored")
    BLOB_CORRUPT = Code(Kind.FAILED, "a stored blob is not its digest; restore it from a good copy")
    BLOB_STORE_UNAVAILABLE = Code(Kind.UNAVAILABLE, "the blob store cannot be reached or failed")
    INVALID_BLOB_URL = Code(Kind.INVALID, "the blob store URL is not file:// or a valid s3://bucket/prefix")
    INVALID_SETTING = Code(Kind.INVALID, "a registry setting out of its range")
    DB_NOT_MIGRATED = Code(Kind.UNAVAILABLE, "the database schema is not the one this code needs; run kiln db upgrade")
    PAYLOAD_TOO_LARGE = Code(Kind.INVALID, "a body or upload over the registry's limit", http=413)
    QUERY_TOO_LONG = Code(Kind.INVALID, "a query string over the registry's limit")
    RANGE_NOT_SATISFIABLE = Code(Kind.INVALID, "a byte range outside the content", http=416)
    BAD_REQUEST = Code(Kind.INVALID, "a request the web framework could not read", http=400)
    METHOD_NOT_ALLOWED = Code(Kind.INVALID, "the route does not take this method", http=405)
    UNSUPPORTED_MEDIA_TYPE = Code(Kind.INVALID, "a body of a content type the route does not take", http=415)
    HTTP_ERROR = Code(Kind.FAILED, "another HTTP error of the web framework, with its status", http_varies=True)
    STORED_VALUE_UNREADABLE = Code(
        Kind.FAILED,
        "in a 200 answer, in place of a JSON value an older registry stored outside today's bounds; the row is kept",
        http=200,
    )

    # The registry: tokens, webhooks and hardware.
    INVALID_TOKEN = Code(Kind.UNAUTHORIZED, "the token is malformed, unknown, revoked or expired")
    INVALID_SCOPE = Code(Kind.INVALID, "a token scope that does not exist")
    INVALID_PATTERN = Code(Kind.INVALID, "a model pattern that is not 1 to 64 name characters with * ? [ ]")
    PATTERN_TOO_COMPLEX = Code(Kind.INVALID, "a model pattern too costly to compare with others")
    TOO_MANY_PATTERNS = Code(Kind.INVALID, "a token naming more model patterns than allowed")
    UNKNOWN_EVENT = Code(Kind.INVALID, "a webhook event that does not exist")
    INVALID_WEBHOOK_URL = Code(Kind.INVALID, "a webhook URL that is not valid")
    WEBHOOK_DESTINATION_FORBIDDEN = Code(Kind.INVALID, "a webhook host that is (or resolves to) an address not allowed")
    WEBHOOK_DESTINATION_UNRESOLVABLE = Code(Kind.INVALID, "a webhook host name that resolves to no address")
    WEBHOOK_INACTIVE = Code(Kind.CONFLICT, "the webhook was deleted")
    DELIVERY_PENDING = Code(Kind.CONFLICT, "a redelivery of a delivery still pending")

    # The registry: the Hugging Face Hub and OCI APIs.
    INVALID_REVISION = Code(Kind.INVALID, "a Hub revision that is not a channel, version or commit id", http=400)
    REPO_NOT_FOUND = Code(Kind.NOT_FOUND, "no such Hub repository (model)")
    REVISION_NOT_FOUND = Code(Kind.NOT_FOUND, "no such revision of the Hub repository")
    ENTRY_NOT_FOUND = Code(Kind.NOT_FOUND, "no such file or folder in the revision")
    NAME_INVALID = Code(Kind.INVALID, "an OCI repository name kiln does not serve", http=400)
    NAME_UNKNOWN = Code(Kind.NOT_FOUND, "no such OCI repository")
    MANIFEST_UNKNOWN = Code(Kind.NOT_FOUND, "no such OCI manifest")
    BLOB_UNKNOWN = Code(Kind.NOT_FOUND, "no such blob in the OCI repository")
    DIGEST_INVALID = Code(Kind.INVALID, "an OCI digest that is not sha256:<64 lowercase hex>", http=400)
    TAG_INVALID = Code(Kind.INVALID, "an OCI tag that breaks the tag grammar", http=400)
    OCI_ENDPOINT_UNKNOWN = Code(Kind.NOT_FOUND, "no OCI endpoint at this path")
    OCI_PUSH_UNSUPPORTED = Code(Kind.INVALID, "a push: the registry is pull-only over OCI", http=405)
    MODELCAR_BASE_INVALID = Code(Kind.INVALID, "the model-car base image is not one kiln can build on")
    MODELCAR_BASE_CHANGED = Code(
        Kind.UNAVAILABLE, "the model-car base image changed on disk since the registry started"
    )

    # kiln routing render.
    ROUTING_NO_POOLS = Code(Kind.INVALID, "no hardware pools given")
    ROUTING_POOL_INVALID = Code(Kind.INVALID, "a --pool that is not one SKU with its device count")
    ROUTING_OPTION_INVALID = Code(Kind.INVALID, "a routing option out of its range")
    ROUTING_FORMAT_UNKNOWN = Code(Kind.INVALID, "a routing format that does not exist")
    ROUTING_CHANNEL_EMPTY = Code(Kind.NOT_FOUND, "the channel points at no release")
    ROUTING_SPLIT_CHANGING = Code(Kind.CONFLICT, "the channel's split changed on every read; try again")
    ROUTING_SPLIT_NOT_WHOLE_PERCENT = Code(Kind.INVALID, "a split KServe cannot express in whole percents")
    ROUTING_TP_UNSUPPORTED = Code(Kind.INVALID, "the runtime serves the artifact at another tensor parallelism")
    ROUTING_RUNTIME_UNKNOWN = Code(Kind.INVALID, "no serving runtime is known for the artifact's target and format")
    ROUTING_RUNTIME_UNSUPPORTED = Code(Kind.INVALID, "the serving runtime has no KServe runtime")
    ROUTING_HARDWARE_UNSUPPORTED = Code(Kind.INVALID, "hardware with no Kubernetes device plugin to request it by")
    ROUTING_NO_MODELCARS = Code(Kind.NOT_FOUND, "the registry serves no model cars")
    ROUTING_MODELCAR_MISSING = Code(Kind.NOT_FOUND, "the registry has no model car for an artifact of the split")
    ROUTING_MODELCAR_TAG_INVALID = Code(Kind.INVALID, "an artifact whose OCI tag would break the tag grammar")


_MARKERS = {
    "cli": ("<!-- error-codes:cli:begin -->", "<!-- error-codes:cli:end -->"),
    "registry": ("<!-- error-codes:registry:begin -->", "<!-- error-codes:registry:end -->"),
}
DOCS: Mapping[str, Path] = {"cli": Path("docs/cli.md"), "registry": Path("docs/registry.md")}


def _cell(entry: ErrorCode, view: str) -> str:
    if view == "cli":
        return ", ".join(str(entry.exit_status(k)) for k in entry.kinds)
    if entry.http_varies:
        return "its own"
    return ", ".join(dict.fromkeys(str(entry.http_status(k)) for k in entry.kinds))


def markdown(view: str) -> str:
    """The table of every code for docs/cli.md (exit statuses) or docs/registry.md (HTTP statuses)."""
    if view == "cli":
        lines = ["| exit | kind |", "|---|---|", "| 0 | ok |"]
        kinds = {k.exit_status: k.what for k in reversed(Kind)}  # one line per status: the first kind's
        lines += [f"| {status} | {what} |" for status, what in sorted(kinds.items())]
        lines += ["", "| code | exit | meaning |", "|---|---|---|"]
    else:
        lines = ["| code | HTTP | meaning |", "|---|---|---|"]
    lines += [
        f"| `{e.code}` | {_cell(e, view)} | {e.meaning} |" for e in sorted(CATALOG.values(), key=lambda e: e.code)
    ]
    return "\n".join(lines) + "\n"


def with_table(text: str, view: str) -> str:
    """`text` (a doc) with the generated block between its markers replaced by `markdown(view)`."""
    begin, end = _MARKERS[view]
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no {begin} ... {end} block")
    return pattern.sub(lambda _: f"{begin}\n{markdown(view)}{end}", text, count=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.core.error_codes", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", choices=sorted(_MARKERS), help="print the table for this doc")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the tables in docs/ (from the repo root)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown), end="")
    if args.write_docs:
        for view, path in DOCS.items():
            path.write_text(with_table(path.read_text(encoding="utf-8"), view), encoding="utf-8")


if __name__ == "__main__":
    main()
