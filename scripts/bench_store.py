#!/usr/bin/env python3
"""Artifact store throughput: checkpoint write (put_folder) and read (get_folder) of a LoRA-sized
(25 MB) and a full-weight-sized (540 MB) checkpoint through the ``s3`` store against boto3's own
``upload_file`` / ``download_file`` of the same files to the same S3 server (a real SeaweedFS on
loopback, boto3's default transfer settings), the peer a user would otherwise write. Also measured:
the ``local`` store (the scheduler's, in its own process, over gRPC from a trainer, as in
production); one SHA-256 pass over the files (what a put hashes); the ceiling of
the gRPC transport (an empty stream: the same ``UploadChunks`` / ``DownloadArtifact`` messages to
a server in its own process that keeps nothing); and the added resume time, cold cache
(download) against warm cache (a hit: nothing downloaded). For the S3 paths the result also
gives the least CPU seconds of one write and one read in this process (SeaweedFS's not counted).

Every timed operation starts after ``os.sync()`` (no dirty pages of the one before). Each round
measures every path, the store and boto3 in alternating order, so both see the same machine; the
figures are the best of ``--repeat`` rounds. The ratio is the store's MB/s over boto3's.

Run as ``make bench-store`` (result in benchmarks/results/store-boto3.json). Options:
``--sizes-mb 25 540``, ``--repeat 3``, ``--no-s3`` (no boto3 peer then).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")]

from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

#: The peer's row: boto3's own transfers to the same server.
BOTO3 = "boto3 (SeaweedFS)"


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


def timed(fn, cpu_s: list[float] | None = None) -> float:
    """Seconds ``fn`` takes; the CPU seconds of this process's threads meanwhile go to ``cpu_s``."""
    os.sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    wall = time.perf_counter() - start
    if cpu_s is not None:
        cpu_s.append(time.process_time() - cpu_start)
    return wall


# ---------------------------------------------------------------------- the transport's ceiling


def _serve_empty(port_q, total: int) -> None:
    """An ArtifactService that keeps nothing: ``UploadChunks`` counts the bytes, ``DownloadArtifact``
    sends ``total`` bytes in CHUNK_BYTES chunks from memory. Same server options as the scheduler."""
    from opentinker.artifact.v1 import artifact_pb2, artifact_pb2_grpc
    import grpc

    from opentinker_common.artifacts.manifest import CHUNK_BYTES
    from opentinker_common.net.grpc_options import server_options
    from opentinker_common.glibc_malloc import tune_malloc

    tune_malloc(stream_buffers=True)  # as the scheduler does (unless the run keeps glibc's settings)
    block = os.urandom(CHUNK_BYTES)

    class Empty(artifact_pb2_grpc.ArtifactServiceServicer):
        async def UploadChunks(self, request_iterator, context):
            n = 0
            async for chunk in request_iterator:
                n += len(chunk.data)
            return artifact_pb2.UploadChunksResponse(received_bytes=[n])

        async def DownloadArtifact(self, request, context):
            for offset in range(0, total, CHUNK_BYTES):
                data = block[: min(CHUNK_BYTES, total - offset)]
                yield artifact_pb2.DownloadArtifactResponse(
                    chunk=artifact_pb2.ArtifactChunk(file_index=0, offset=offset, data=data)
                )

    async def main() -> None:
        server = grpc.aio.server(options=server_options())
        artifact_pb2_grpc.add_ArtifactServiceServicer_to_server(Empty(), server)
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


class EmptyStream:
    """The ceiling: the bytes of a folder as the trainer's upload sends them (read from the files,
    CHUNK_BYTES messages) and as many bytes downloaded, to and from :func:`_serve_empty`."""

    def __init__(self, total: int) -> None:
        import grpc
        from opentinker.artifact.v1 import artifact_pb2_grpc

        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_serve_empty, args=(q, total), daemon=True)
        self.proc.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{q.get(timeout=60)}")
        self.stub = artifact_pb2_grpc.ArtifactServiceStub(self.channel)

    def upload(self, folder: Path) -> None:
        from opentinker_common.artifacts.manifest import FileEntry, Manifest
        from opentinker_common.artifacts.remote import _chunks

        files = sorted(p for p in folder.rglob("*") if p.is_file())
        entries = [FileEntry(p.relative_to(folder).as_posix(), p.stat().st_size, "0" * 64) for p in files]
        m = Manifest("bench/empty", tuple(entries))
        paths = {e.path: p for p, e in zip(files, entries)}
        self.stub.UploadChunks(_chunks("0" * 32, m, paths, [0] * len(m.files)))

    def download(self) -> None:
        from opentinker.artifact.v1 import artifact_pb2

        for msg in self.stub.DownloadArtifact(artifact_pb2.DownloadArtifactRequest(key="bench/empty")):
            msg.chunk.data  # noqa: B018 - read the bytes, as get_folder does

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.join(10)


def start_scheduler(tmp: Path):
    """A real scheduler in its own process (as in production: its event loop and the trainer
    do not share a GIL), default artifact settings (``local``)."""
    from tests.support.procs import Cluster

    tmp.mkdir(parents=True)
    cluster = Cluster(tmp, "heartbeat_interval: 5\nlease: 30\n")
    cluster.start_scheduler()
    return cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[25, 540])
    parser.add_argument("--repeat", type=int, default=3, help="best of N rounds")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's heap settings as they are here and in the scheduler (what main did before)",
    )
    args = parser.parse_args()

    import grpc

    from opentinker_common.glibc_malloc import KEEP_MALLOC_ENV, tune_malloc

    if args.default_malloc:
        os.environ[KEEP_MALLOC_ENV] = "1"  # the scheduler started below inherits it
    tune_malloc(stream_buffers=True)  # as a task worker does at start (this process plays the trainer)

    from opentinker_common.artifacts import S3ArtifactStore, S3Location
    from opentinker_common.artifacts.manifest import scan_folder
    from opentinker_common.artifacts.remote import RemoteArtifactStore
    from opentinker_trainer.worker_artifacts import ArtifactCache

    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    results = []
    #: (size, path): the least CPU seconds of one write and of one read, this process only.
    cpu_least: dict[tuple[int, str], tuple[float, float]] = {}
    closers = []
    try:
        cluster = start_scheduler(tmp / "sched")
        closers.append(cluster.close)
        target = f"127.0.0.1:{cluster.port}"
        channel = grpc.insecure_channel(target)  # as a trainer's: gRPC's default message limits
        closers.append(channel.close)
        stores = {"local (gRPC)": RemoteArtifactStore(channel, target=target)}
        if not args.no_s3:
            from tests.support.seaweedfs import start_seaweedfs

            weed = start_seaweedfs(tmp / "weed", max_volumes=120)  # room for every round's checkpoints
            closers.append(weed.stop)
            os.environ.update(weed.env())
            stores["s3 (SeaweedFS)"] = S3ArtifactStore(S3Location(bucket=weed.bucket, endpoint=weed.endpoint))
            stores[BOTO3] = None  # the peer: boto3's own transfers, timed in the loop below
            client = weed.client()
        for size in args.sizes_mb:
            src = make_checkpoint(tmp / f"src-{size}", size)
            total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
            mb = total / 1e6
            empty = EmptyStream(total)
            n = 0

            def fresh(kind: str) -> Path:
                nonlocal n
                n += 1
                return tmp / f"{kind}-{size}-{n}"

            best: dict[str, list[float]] = {}
            #: CPU seconds of each write and read, this process's threads only.
            cpu: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in stores}

            def keep(name: str, put: float, get: float) -> None:
                old = best.get(name, [float("inf"), float("inf")])
                best[name] = [min(old[0], put), min(old[1], get)]

            for r in range(args.repeat):
                keep("sha256, one pass", timed(lambda: scan_folder(src)), float("inf"))
                keep("empty gRPC stream", timed(lambda: empty.upload(src)), timed(empty.download))
                names = list(stores) if r % 2 == 0 else list(reversed(stores))
                for name in names:
                    store = stores[name]
                    if store is None:
                        key = f"bench-boto3/{size}/r{r}"
                        got = fresh("get")
                        keep(name, timed(lambda: boto3_put(client, weed.bucket, key, src), cpu[name][0]), float("inf"))
                        keep(name, float("inf"), timed(lambda: boto3_get(client, weed.bucket, key, got), cpu[name][1]))
                        shutil.rmtree(got)
                        continue
                    # A new key each round: a put of content already committed under the key sends
                    # nothing to the local store (BeginUpload says committed), which is no write.
                    key = f"bench/{size}/r{r}"
                    put = timed(lambda: store.put_folder(key, src), cpu[name][0])
                    got = fresh("get")
                    get = timed(lambda: store.get_folder(key, got), cpu[name][1])
                    shutil.rmtree(got)
                    keep(name, put, get)
                    if r < args.repeat - 1 and store.backend == "s3":
                        store.delete(key)  # SeaweedFS frees the space when it vacuums
            # the S3 paths only: the local store's work is mostly in the scheduler's process
            s3_paths = [name for name, store in stores.items() if store is None or store.backend == "s3"]
            cpu_least.update(((size, name), (min(cpu[name][0]), min(cpu[name][1]))) for name in s3_paths)
            sha = best["sha256, one pass"][0]
            results.append((size, "sha256, one pass", mb / sha, float("nan"), None, None))
            e_put, e_get = best["empty gRPC stream"]
            results.append((size, "empty gRPC stream", mb / e_put, mb / e_get, None, None))
            for name, store in stores.items():
                put, get = best[name]
                if store is None:
                    results.append((size, name, mb / put, mb / get, None, None))
                    continue
                ref = store.manifest(f"bench/{size}/r{args.repeat - 1}").ref()
                cache = ArtifactCache(fresh("cache"), 10 * 1024**3)
                cold = timed(lambda: cache.fetch(store, ref))
                warm = timed(lambda: cache.fetch(store, ref))
                results.append((size, name, mb / put, mb / get, cold, warm))
            empty.close()
            for p in tmp.glob(f"*-{size}-*"):
                shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(tmp, ignore_errors=True)
    head = f"{'checkpoint':>10} {'path':<18} {'write MB/s':>10} {'x boto3':>7} {'read MB/s':>10} {'x boto3':>7}"
    print(f"{head} {'resume cold s':>13} {'warm s':>7}")
    for size, name, w, r, cold, warm in results:
        peer = next((x for x in results if x[0] == size and x[1] == BOTO3), None)
        c = f"{cold:13.2f}" if cold is not None else f"{'':>13}"
        h = f"{warm:7.3f}" if warm is not None else f"{'':>7}"
        wx = f"{w / peer[2]:7.2f}" if peer else f"{'':>7}"
        if r != r:  # nan: no read
            read = " " * 18
        else:
            read = f"{r:10.0f} " + (f"{r / peer[3]:7.2f}" if peer else " " * 7)
        print(f"{size:>8}MB {name:<18} {w:10.0f} {wx} {read} {c} {h}")
    _write_result(args, results, cpu_least)
    return 0


def boto3_put(client, bucket: str, key: str, folder: Path) -> None:
    """The peer's write: ``upload_file`` of each file, boto3's default transfer settings."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{key}/{p.relative_to(folder).as_posix()}")


def boto3_get(client, bucket: str, key: str, folder: Path) -> None:
    """The peer's read: list the key's objects, ``download_file`` each."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        for obj in page.get("Contents", ()):
            dest = folder / obj["Key"][len(key) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(dest))


def _write_result(args: argparse.Namespace, results: list, cpu_least: dict) -> None:
    rows = {(size, name): (w, r) for size, name, w, r, _, _ in results}
    if (args.sizes_mb[0], BOTO3) not in rows:
        return  # --no-s3: no peer to compare with
    ratios = []
    for size in args.sizes_mb:
        (sw, sr), (bw, br) = rows[(size, "s3 (SeaweedFS)")], rows[(size, BOTO3)]
        ratios.append({"label": f"{size} MB write MB/s, s3 store / boto3", "value": round(sw / bw, 3)})
        ratios.append({"label": f"{size} MB read MB/s, s3 store / boto3", "value": round(sr / br, 3)})
    write_result(
        "store-boto3",
        what="Artifact store: checkpoint write (put_folder) and read (get_folder) through the s3 store",
        peer="boto3 upload_file / download_file of the same files, same SeaweedFS on loopback",
        ratios=ratios,
        goal=">= 0.8x",
        settings={"sizes_mb": args.sizes_mb, "repeat": args.repeat, "best_of": args.repeat},
        make="make bench-store",
        notes=(
            "Both sides run in the bench process against one SeaweedFS process, with boto3's transfer manager "
            "at its default settings. The store hashes every file (SHA-256) while it sends or receives it, "
            "checks each object's size before it commits a manifest and each file's hash after a read; "
            "boto3 alone does none of these. Each S3 path's CPU seconds in the bench process are in the details "
            "(write_cpu_s, read_cpu_s; SeaweedFS's not counted): on a read the store's extra is that SHA-256 pass, "
            "which reads the written bytes in order through a memory map of the file. SeaweedFS shares the machine's "
            "cores, so the ratios move with the machine's load."
        ),
        details={
            f"{size} MB {name}": {"write_mb_s": round(w), "read_mb_s": round(r) if r == r else None}
            | (
                {"write_cpu_s": round(cpu_least[size, name][0], 2), "read_cpu_s": round(cpu_least[size, name][1], 2)}
                if (size, name) in cpu_least
                else {}
            )
            for (size, name), (w, r) in rows.items()
        },
    )


if __name__ == "__main__":
    sys.exit(main())
