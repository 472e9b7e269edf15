"""Benchmark: a 1 GiB blob up to and down from a registry over HTTP, beside what bounds each, in one run.

    python bench/blob_transfer.py [--size-mib 1024] [--repeat 2]

Serves a fresh embedded registry (SQLite, blobs on local disk) with `kiln serve` on a free loopback
port. The upload is `PUT /v1/blobs/{sha256}` of a random file, streamed by curl (`-T file`,
no `Expect: 100-continue`); the download is `GET /v1/blobs/{sha256}` into /dev/null by curl. Beside
them, on the same bytes in the same run, the two costs an upload cannot avoid: sha256 with Python's
hashlib (OpenSSL; the registry hashes while it streams) and `dd conv=fsync` (a copy made durable:
the registry syncs the file before it renames it into place). Each figure is the best of --repeat.
Targets (DESIGN.md): uploads >= 500 MB/s, downloads >= 1,000 MB/s.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script
from serving import best_seconds, kiln_serve, random_file, sha256_seconds  # bench/serving.py

ROOT = Path(__file__).resolve().parents[1]
TARGETS_MB_S = {"upload": 500.0, "download": 1000.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="where the file and the registry go (default: a temp dir)")
    add_record_argument(ap, "blob_transfer")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        blob = work / "blob.bin"
        sha = random_file(blob, args.size_mib)
        nbytes = blob.stat().st_size
        sys.path.insert(0, str(ROOT))
        from kiln.client import RegistryClient  # creates and migrates the embedded registry
        from kiln.registry.settings import RegistrySettings

        data = work / "registry"
        RegistryClient.connect(data).close()
        settings = RegistrySettings(data_dir=data, auth_required=True)
        from kiln.registry.app import create_app
        from tests.registry.conftest import make_token

        app = create_app(settings)
        token = make_token(app, ["admin"], name="bench")
        app.state.engine.dispose()
        with kiln_serve(data) as host:
            url = f"{host}/v1/blobs/{sha}"
            auth = ["-H", f"Authorization: Bearer {token}"]
            blob_dir = data / "blobs" / sha[:2] / sha[2:4]
            upload = [
                "curl",
                "-sf",
                *auth,
                "-H",
                "Expect:",
                "-H",
                "Content-Type: application/octet-stream",
                "-T",
                str(blob),
                url,
            ]
            # Each upload starts from an empty store: the blob is removed first (a stored one is only confirmed).
            up_s = best_seconds(upload, args.repeat, before=lambda: shutil.rmtree(blob_dir, ignore_errors=True))
            shutil.rmtree(blob_dir, ignore_errors=True)
            subprocess.run(upload, check=True, capture_output=True)  # stored, for the downloads
            down_s = best_seconds(["curl", "-sf", *auth, "-o", "/dev/null", url], args.repeat)
        hash_s = sha256_seconds(blob, args.repeat)
        copy = work / "copy.bin"
        durable = ["dd", f"if={blob}", f"of={copy}", "bs=8M", "conv=fsync", "status=none"]
        sync_s = best_seconds(durable, args.repeat, before=lambda: copy.unlink(missing_ok=True))
        shutil.rmtree(data, ignore_errors=True)

    rows = {
        "upload": nbytes / up_s / 1e6,
        "download": nbytes / down_s / 1e6,
        "sha256": nbytes / hash_s / 1e6,
        "dd fsync": nbytes / sync_s / 1e6,
    }
    print(f"{args.size_mib} MiB blob, best of {args.repeat}")
    print(f"{'what':>10} {'MB/s':>8}  target")
    for name, mb_s in rows.items():
        target = f">= {TARGETS_MB_S[name]:.0f}" if name in TARGETS_MB_S else "(bound)"
        print(f"{name:>10} {mb_s:>8.0f}  {target}")
    save_record(run_record(size_mib=args.size_mib, mb_s=rows), args.record)


if __name__ == "__main__":
    main()
