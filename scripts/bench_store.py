#!/usr/bin/env python3
"""Artifact store throughput: checkpoint write (put_folder) and read (get_folder) of a LoRA-sized
(25 MB) and a full-weight-sized (540 MB) checkpoint through the ``local`` store (the scheduler's,
over gRPC from a trainer, as in production) and ``s3`` (a real SeaweedFS on loopback), against a
plain file copy (``shutil.copytree``) of the same folder in the same run; and the added resume
time, cold cache (download) against warm cache (a hit: nothing downloaded).

Run as ``make bench-store`` (figures in BENCHMARKS.md). Options: ``--sizes-mb 25 540``, ``--repeat 2``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]


def make_checkpoint(folder: Path, total_mb: int) -> Path:
    """A folder shaped like a checkpoint: one big weights file, a config, a trainer state."""
    folder.mkdir(parents=True)
    weights = max(1, total_mb - 1) * 1024 * 1024
    with open(folder / "model.safetensors", "wb") as f:
        block = os.urandom(1024 * 1024)
        for _ in range(weights // len(block)):
            f.write(block)
    (folder / "config.json").write_text('{"r": 16}')
    (folder / "trainer_state.pt").write_bytes(os.urandom(512 * 1024))
    return folder


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[25, 540])
    parser.add_argument("--repeat", type=int, default=2, help="best of N")
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()

    from opentinker_common.artifacts import S3ArtifactStore, S3Location
    from opentinker_common.artifacts.remote import RemoteArtifactStore
    from opentinker_trainer.artifacts import ArtifactCache
    from tests.support.security import LoopbackScheduler

    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    results = []
    servers = []
    try:
        sched = LoopbackScheduler(tmp / "state")
        servers.append(sched)
        channel = sched.channel()
        stores = {"local (gRPC)": RemoteArtifactStore(channel, target=sched.target)}
        if not args.no_s3:
            from tests.support.seaweedfs import start_seaweedfs

            weed = start_seaweedfs(tmp / "weed")
            servers.append(weed)
            os.environ.update(weed.env())
            stores["s3 (SeaweedFS)"] = S3ArtifactStore(S3Location(bucket=weed.bucket, endpoint=weed.endpoint))
        for size in args.sizes_mb:
            src = make_checkpoint(tmp / f"src-{size}", size)
            mb = sum(p.stat().st_size for p in src.rglob("*")) / 1e6
            n = 0

            def fresh(kind: str) -> Path:
                nonlocal n
                n += 1
                return tmp / f"{kind}-{size}-{n}"

            copy = min(timed(lambda: shutil.copytree(src, fresh("copy"))) for _ in range(args.repeat))
            results.append((size, "plain copy", mb / copy, mb / copy, None, None))
            for name, store in stores.items():
                # A new key each time: a put of content already committed under the key sends
                # nothing to the local store (BeginUpload says committed), which is no write.
                keys = [f"bench/{size}/x{i}" for i in range(args.repeat)]
                put = min(timed(lambda k=k: store.put_folder(k, src)) for k in keys)
                key = keys[-1]
                get = min(timed(lambda: store.get_folder(key, fresh("get"))) for _ in range(args.repeat))
                ref = store.manifest(key).ref()
                cache = ArtifactCache(fresh("cache"), 10 * 1024**3)
                cold = timed(lambda: cache.fetch(store, ref))
                warm = timed(lambda: cache.fetch(store, ref))
                results.append((size, name, mb / put, mb / get, cold, warm))
            for p in tmp.glob(f"*-{size}-*"):
                shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
        channel.close()
    finally:
        for s in reversed(servers):
            (s.close if hasattr(s, "close") else s.stop)()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'checkpoint':>10} {'path':<16} {'write MB/s':>10} {'read MB/s':>10} {'resume cold s':>13} {'warm s':>7}")
    for size, name, w, r, cold, warm in results:
        c = f"{cold:13.2f}" if cold is not None else f"{'':>13}"
        h = f"{warm:7.3f}" if warm is not None else f"{'':>7}"
        print(f"{size:>8}MB {name:<16} {w:10.0f} {r:10.0f} {c} {h}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
