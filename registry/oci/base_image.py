"""A model car's base image: the operator's OCI image layout (the shell KServe runs), read once and served as is.

KServe runs a model car as a sidecar whose command is a shell, `sh -c 'ln -sf /proc/$$/root/models /mnt/
&& sleep infinity'`, so its image needs `sh`, `ln` and `sleep` under the model files. The registry holds no
such thing: the operator names an OCI image layout (`KILN_REGISTRY_MODELCAR_BASE`), for instance what
`skopeo copy docker://registry.access.redhat.com/ubi9/ubi-micro oci:/srv/kiln/modelcar-base` writes, or
`kiln modelcar-base DIR` from a static busybox. It is checked when the registry starts (every blob against
its digest and size, the platform, the layer types) and its layers are served from that directory.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from kiln.core.datafile import read_data_bytes
from kiln.core.digest import canonical_json
from kiln.core.errors import ModelCarBaseInvalid
from kiln.registry.oci import media_types as mt

# The largest JSON document (index, manifest, config) read from a layout; real ones are a few KiB.
MAX_DOCUMENT_BYTES: Final = 4 * 1024 * 1024
# ELF e_machine -> OCI architecture, for a base built from a static binary.
ELF_ARCHITECTURES: Final = {62: "amd64", 183: "arm64", 243: "riscv64", 21: "ppc64le", 22: "s390x"}
ELF_PT_INTERP: Final = 3  # a program header naming the dynamic loader
# What `kiln modelcar-base` links to busybox: what KServe's command and a look inside need.
BUSYBOX_APPLETS: Final = ("sh", "ln", "sleep", "ls", "cat", "sha256sum")
MAX_BUSYBOX_BYTES: Final = 64 * 1024 * 1024  # a static busybox is 1-3 MiB


@dataclass(frozen=True)
class BaseImage:
    """One platform's image from an OCI layout: its manifest's digest, config, and layer descriptors."""

    layout: Path
    platform: str
    manifest_digest: str
    name: str | None  # the tag the layout's index gives it, if any
    config: dict[str, Any]
    layers: tuple[dict[str, Any], ...]  # descriptors: mediaType, digest, size

    @property
    def diff_ids(self) -> list[str]:
        return list(self.config["rootfs"]["diff_ids"])

    def layer(self, sha256: str) -> dict[str, Any] | None:
        return next((d for d in self.layers if d["digest"] == f"sha256:{sha256}"), None)

    def blob_path(self, sha256: str) -> Path:
        return self.layout / "blobs" / "sha256" / sha256


def _invalid(layout: Path, message: str) -> ModelCarBaseInvalid:
    return ModelCarBaseInvalid(f"model car base image {str(layout)!r}: {message}", details={"layout": str(layout)})


def _check_blob(layout: Path, descriptor: Any) -> Path:
    """The file of a descriptor's blob, after checking its digest and size."""
    if not isinstance(descriptor, dict):
        raise _invalid(layout, f"a descriptor is not an object: {descriptor!r:.100}")
    digest, size = descriptor.get("digest"), descriptor.get("size")
    match = mt.DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _invalid(layout, f"descriptor {descriptor!r:.200} needs a sha256 digest and a size")
    path = layout / "blobs" / "sha256" / match["hex"]
    if not path.is_file() or path.stat().st_size != size:
        raise _invalid(layout, f"blob {digest} is missing or not {size} bytes")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != match["hex"]:
        raise _invalid(layout, f"blob {digest} does not have that digest")
    return path


def _document(layout: Path, descriptor: Any, media_type: str) -> dict[str, Any]:
    path = _check_blob(layout, descriptor)
    if descriptor.get("mediaType") != media_type:
        raise _invalid(layout, f"{descriptor.get('digest')} is {descriptor.get('mediaType')!r}, not {media_type!r}")
    if path.stat().st_size > MAX_DOCUMENT_BYTES:
        raise _invalid(layout, f"{descriptor['digest']} is over {MAX_DOCUMENT_BYTES} bytes")
    return _json(layout, path)


def _json(layout: Path, path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise _invalid(layout, f"{path.name} is not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise _invalid(layout, f"{path.name} is not a JSON object")
    return value


def _manifests(layout: Path, index: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
        raise _invalid(layout, "an index needs a list of manifest descriptors")
    return manifests


def _ref_name(entry: dict[str, Any]) -> str | None:
    annotations = entry.get("annotations")
    name = annotations.get(mt.REF_NAME) if isinstance(annotations, dict) else None
    return name if isinstance(name, str) else None


def _platform_of(config: dict[str, Any]) -> str:
    return f"{config.get('os')}/{config.get('architecture')}"


def load_base_image(layout: Path, platform: str = "linux/amd64") -> BaseImage:
    """The image for `platform` in the OCI image layout at `layout`, every blob it needs checked.

    The layout's index may list the image itself or an image index (a multi-platform image) holding
    it; when it lists several, the first for `platform` is taken."""
    layout = Path(layout)
    if not (layout / "index.json").is_file():
        raise _invalid(layout, "not an OCI image layout (no index.json); write one with skopeo copy ... oci:DIR")
    if (layout / "index.json").stat().st_size > MAX_DOCUMENT_BYTES:
        raise _invalid(layout, f"index.json is over {MAX_DOCUMENT_BYTES} bytes")
    index = _json(layout, layout / "index.json")
    seen: list[str] = []
    pending = [(entry, _ref_name(entry)) for entry in _manifests(layout, index)]
    while pending:
        entry, name = pending.pop(0)
        if entry.get("mediaType") == mt.IMAGE_INDEX:
            nested = _document(layout, entry, mt.IMAGE_INDEX)
            pending[:0] = [(e, name) for e in _manifests(layout, nested)]
            continue
        wanted = entry.get("platform")
        if isinstance(wanted, dict) and _platform_of(wanted) != platform:
            seen.append(_platform_of(wanted))
            continue
        manifest = _document(layout, entry, mt.IMAGE_MANIFEST)
        config = _document(layout, manifest.get("config"), mt.IMAGE_CONFIG)
        if _platform_of(config) != platform:
            seen.append(_platform_of(config))
            continue
        return _image(layout, platform, entry, name, manifest, config)
    raise _invalid(layout, f"no image for {platform} (it has: {', '.join(seen) or 'no images'})")


def _image(
    layout: Path,
    platform: str,
    entry: dict[str, Any],
    name: str | None,
    manifest: dict[str, Any],
    config: dict[str, Any],
) -> BaseImage:
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not layers:
        raise _invalid(layout, "the image has no layers (it needs at least a shell)")
    for layer in layers:
        _check_blob(layout, layer)
        if layer.get("mediaType") not in mt.BASE_LAYER_TYPES:
            raise _invalid(
                layout, f"layer {layer.get('digest')} is {layer.get('mediaType')!r}; OCI tar layers only (skopeo oci:)"
            )
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise _invalid(layout, "the config's rootfs.diff_ids do not match the manifest's layers")
    if not all(isinstance(d, str) and mt.DIGEST.fullmatch(d) for d in diff_ids):
        raise _invalid(layout, "the config's rootfs.diff_ids are not all sha256 digests")
    descriptors = tuple({k: layer[k] for k in ("mediaType", "digest", "size")} for layer in layers)
    return BaseImage(
        layout=layout,
        platform=platform,
        manifest_digest=str(entry["digest"]),
        name=name,
        config=config,
        layers=descriptors,
    )


def _tar_entry(tar: tarfile.TarFile, name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, len(data), link, 0
    tar.addfile(info, io.BytesIO(data) if data else None)


def _write_blob(layout: Path, body: bytes) -> dict[str, Any]:
    sha256 = hashlib.sha256(body).hexdigest()
    (layout / "blobs" / "sha256" / sha256).write_bytes(body)
    return {"digest": f"sha256:{sha256}", "size": len(body)}


def static_elf_architecture(binary: bytes, name: str) -> str:
    """The OCI architecture of a statically linked 64-bit ELF executable; MODELCAR_BASE_INVALID otherwise
    (a dynamically linked shell would not start in an image that has no loader)."""
    if len(binary) < 64 or binary[:4] != b"\x7fELF" or binary[4] != 2 or binary[5] not in (1, 2):
        raise ModelCarBaseInvalid(f"{name!r} is not a 64-bit ELF executable")
    order: Literal["little", "big"] = "little" if binary[5] == 1 else "big"

    def field(offset: int, size: int) -> int:
        return int.from_bytes(binary[offset : offset + size], order)

    architecture = ELF_ARCHITECTURES.get(field(18, 2))
    if architecture is None:
        raise ModelCarBaseInvalid(f"{name!r} is for an architecture kiln does not name")
    table, entry_size, count = field(32, 8), field(54, 2), field(56, 2)
    for i in range(count):
        if field(table + i * entry_size, 4) == ELF_PT_INTERP:
            raise ModelCarBaseInvalid(f"{name!r} is dynamically linked; use a static one (Debian: busybox-static)")
    return architecture


def write_busybox_base(busybox: Path, layout: Path, name: str = "busybox") -> str:
    """Write an OCI image layout whose one layer is a static busybox with the applets a model car needs.

    Deterministic (mtime 0, root-owned, fixed order): the same binary always gives the same digests.
    Returns the manifest's digest."""
    binary = read_data_bytes(Path(busybox), "a busybox", MAX_BUSYBOX_BYTES, ModelCarBaseInvalid)
    architecture = static_elf_architecture(binary, str(busybox))
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "mnt", "proc", "tmp"):
            _tar_entry(tar, directory, tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755)
        _tar_entry(tar, "bin/busybox", tarfile.REGTYPE, 0o755, binary)
        for applet in BUSYBOX_APPLETS:
            _tar_entry(tar, f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox")
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    layer_descriptor = {"mediaType": mt.LAYER_TAR, **_write_blob(layout, layer.getvalue())}
    config = {
        "architecture": architecture,
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_descriptor["digest"]]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.IMAGE_MANIFEST,
        "config": {"mediaType": mt.IMAGE_CONFIG, **_write_blob(layout, canonical_json(config))},
        "layers": [layer_descriptor],
    }
    manifest_descriptor = {"mediaType": mt.IMAGE_MANIFEST, **_write_blob(layout, canonical_json(manifest))}
    entry = {**manifest_descriptor, "annotations": {mt.REF_NAME: name}}
    (layout / "index.json").write_bytes(
        canonical_json({"schemaVersion": 2, "mediaType": mt.IMAGE_INDEX, "manifests": [entry]})
    )
    return str(manifest_descriptor["digest"])
