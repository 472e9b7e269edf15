"""Benchmark: what a model car costs over the plain OCI artifact, for one large file, in one run.

    python bench/modelcar_pull.py [--size-mib 1024] [--repeat 3]

Serves a fresh embedded registry with `kiln serve` and a model-car base image (`kiln modelcar-base`, from
/bin/busybox where there is one), publishes one sealed artifact holding a random file of --size-mib, and
measures with curl, each figure the best of --repeat:
- from the seal's request to the layer's record (sealing hashes it in the background);
- the first `GET /v2/modelcar/<model>/manifests/<tag>` with nothing recorded (as for a release sealed before
  model cars were configured: it hashes the file's tar layer, and the file's own sha256 to check it; the
  record is deleted before each try), beside sha256 of the same file with Python's hashlib (the ceiling:
  the layer's bytes must be read and hashed once);
- the same manifest once recorded;
- the file's tar layer from `/v2/modelcar/<model>/blobs/<digest>` (header, the stored blob, zeros),
  beside the same file as the ModelPack layer from `/v2/<model>/blobs/<sha256>` (the stored blob itself).
No target in DESIGN.md; the ratios say what the layout costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script
from serving import best_seconds, kiln_serve, random_file, sha256_seconds  # bench/serving.py

ROOT = Path(__file__).resolve().parents[1]
MODEL, VERSION, ARTIFACT = "bench", "1.0", "gguf-q8"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where the file and the registry go (default: a temp dir)")
    add_record_argument(ap, "modelcar_pull")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import httpx
    from sqlalchemy import delete, func, select

    from kiln.client import RegistryClient
    from kiln.registry.app import create_app
    from kiln.registry.oci.base_image import write_busybox_base
    from kiln.registry.oci.models import TarLayer
    from kiln.registry.settings import RegistrySettings
    from tests.registry.conftest import make_token
    from tests.registry.helpers import STAND_IN_EXECUTABLE, make_release, manifest, post_eval, seal

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        weights = work / "model.gguf"
        sha = random_file(weights, args.size_mib)
        nbytes = weights.stat().st_size
        base = work / "base"
        busybox = Path("/bin/busybox")
        if not busybox.is_file():  # the registry serves the base's bytes as they are: a stand-in will do
            busybox = work / "busybox"
            busybox.write_bytes(STAND_IN_EXECUTABLE)
        base.mkdir()
        write_busybox_base(busybox, base)
        data = work / "registry"
        RegistryClient.connect(data).close()
        app = create_app(RegistrySettings(data_dir=data, auth_required=True))
        token = make_token(app, ["admin"], name="bench")
        app.state.engine.dispose()
        with kiln_serve(data, {"KILN_REGISTRY_MODELCAR_BASE": str(base)}) as host:
            auth = ["-H", f"Authorization: Bearer {token}"]
            put = ["curl", "-sf", *auth, "-H", "Expect:", "-T", str(weights), f"{host}/v1/blobs/{sha}"]
            subprocess.run(put, check=True, capture_output=True)
            with httpx.Client(base_url=host, headers={"Authorization": f"Bearer {token}"}, timeout=600) as client:
                make_release(client, model=MODEL, version=VERSION, planned=[ARTIFACT])  # type: ignore[arg-type]
                body = manifest(ARTIFACT, {}, ["cpu"])
                body["files"] = [{"path": weights.name, "sha256": sha, "size": nbytes}]
                created = client.post(f"/v1/models/{MODEL}/releases/{VERSION}/artifacts", json=body)
                assert created.status_code == 201, created.text
                assert post_eval(client, ARTIFACT, "passed", model=MODEL, version=VERSION).status_code == 201  # type: ignore[arg-type]
                sealed_at = time.perf_counter()
                seal(client, model=MODEL, version=VERSION)  # type: ignore[arg-type]

            car = f"{host}/v2/modelcar/{MODEL}"
            get_manifest = ["curl", "-sf", *auth, "-o", "/dev/null", f"{car}/manifests/{VERSION}-{ARTIFACT}"]
            db = create_app(RegistrySettings(data_dir=data))
            # Sealing hashes the layers in the background: wait for that before timing first pulls.
            while True:
                with db.state.session_factory() as session:
                    if session.scalar(select(func.count()).select_from(TarLayer)):
                        break
                if time.perf_counter() - sealed_at > 600:
                    raise SystemExit("the layers were never recorded after the seal")
                time.sleep(0.05)
            seal_to_recorded_s = time.perf_counter() - sealed_at

            def forget() -> None:
                with db.state.write_session_factory() as session:
                    session.execute(delete(TarLayer))
                    session.commit()

            first_s = best_seconds(get_manifest, args.repeat, before=forget)
            recorded_s = best_seconds(get_manifest, args.repeat)
            db.state.engine.dispose()
            shown = subprocess.run(
                ["curl", "-sf", *auth, f"{car}/manifests/{VERSION}-{ARTIFACT}"], check=True, capture_output=True
            )
            layer = json.loads(shown.stdout)["layers"][-1]["digest"]
            tar_s = best_seconds(["curl", "-sf", *auth, "-o", "/dev/null", f"{car}/blobs/{layer}"], args.repeat)
            raw = ["curl", "-sf", *auth, "-o", "/dev/null", f"{host}/v2/{MODEL}/blobs/sha256:{sha}"]
            raw_s = best_seconds(raw, args.repeat)
        hash_s = sha256_seconds(weights, args.repeat)
        shutil.rmtree(data, ignore_errors=True)

    mb_s = {
        "first manifest (hashes the layer)": nbytes / first_s / 1e6,
        "sha256 of the file (ceiling)": nbytes / hash_s / 1e6,
        "tar layer download": nbytes / tar_s / 1e6,
        "ModelPack layer download (peer)": nbytes / raw_s / 1e6,
    }
    ratios = {"first manifest / sha256": hash_s / first_s, "tar layer / ModelPack layer": raw_s / tar_s}
    print(f"{args.size_mib} MiB file, best of {args.repeat}")
    print(f"{'what':>36} {'MB/s':>8}")
    for name, value in mb_s.items():
        print(f"{name:>36} {value:>8.0f}")
    print(f"{'seal to layers recorded':>36} {seal_to_recorded_s:>7.2f} s")
    print(f"{'recorded manifest':>36} {recorded_s * 1000:>7.1f} ms")
    for name, value in ratios.items():
        print(f"{name:>36} {value:>8.2f}x")
    record = run_record(
        size_mib=args.size_mib,
        mb_s=mb_s,
        seal_to_recorded_s=seal_to_recorded_s,
        recorded_manifest_ms=recorded_s * 1000,
        ratios=ratios,
    )
    save_record(record, args.record)


if __name__ == "__main__":
    main()
