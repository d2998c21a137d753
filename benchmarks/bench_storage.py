"""Storage throughput: our backends vs the raw client doing the same work.

    .venv/bin/python benchmarks/bench_storage.py                 # 256 MiB, starts its own MinIO
    .venv/bin/python benchmarks/bench_storage.py --size-mib 64 --repeat 5
    .venv/bin/python benchmarks/bench_storage.py --skip-s3       # filesystem only
    .venv/bin/python benchmarks/bench_storage.py --json out.json

S3 rows run against a real MinIO built from ``e2e/tools/minio`` and started on
127.0.0.1 (or ``--endpoint`` with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
and ``--bucket``). Client and server share this machine's cores, so absolute
numbers say little; the ratio ours/raw is the point (>= ~0.9 means the backend
adds no real overhead). Each row is the median of ``--repeat`` runs, the variants
interleaved so that load from elsewhere hits them alike.

Rows:
  s3 upload    ours ``S3Storage.write`` (one PUT up to a part, then parallel multipart)
               vs ``put_object`` (one PUT of all bytes) and ``upload_fileobj`` (s3transfer
               multipart with the same part size and concurrency)
  s3 stream    ours ``open_write`` fed 8 MiB chunks vs ``upload_fileobj`` again
  s3 download  ours ``read`` (one GET) and ``open_read`` (streamed) vs ``get_object`` and
               ``download_fileobj`` (s3transfer, parallel ranged GETs)
  fs write     ours ``LocalStorage.write`` (temp + fsync + rename + dir fsync) vs
               ``open/write/fsync/close``
  fs read      ours ``LocalStorage.read`` vs ``open().read()``
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from ckpt_agent.storage import StorageOptions  # noqa: E402
from ckpt_agent.storage.fs import LocalStorage  # noqa: E402

MIB = 1024 * 1024


def load_servers() -> Any:
    path = REPO / "tests" / "ckpt_agent" / "storage" / "s3_servers.py"
    spec = importlib.util.spec_from_file_location("ckpt_bench_s3_servers", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def timed(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    setup: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per variant; the variants run interleaved (a, b, c, a, b, c, ...) so
    that a noisy neighbour on this small machine slows them alike. ``setup`` runs
    untimed before each run."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MIB / seconds


def bench_s3(data: bytes, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from ckpt_agent.storage.s3 import S3Storage

    server = None
    workdir = None
    if args.endpoint:
        endpoint, bucket = args.endpoint, args.bucket
        key_id, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    else:
        servers = load_servers()
        print("building/locating MinIO (e2e/build-tools.sh --path minio) ...", file=sys.stderr)
        bin_dir = servers.build_tool("minio")
        workdir = tempfile.TemporaryDirectory(prefix="bench-minio-")
        server = servers.start_minio(bin_dir, Path(workdir.name))
        print(f"MinIO {server.version} at {server.endpoint}", file=sys.stderr)
        endpoint, bucket = server.endpoint, "bench"
        key_id, secret = server.access_key, server.secret_key
    try:
        part = args.part_mib * MIB
        opts = StorageOptions(
            endpoint_url=endpoint,
            region="us-east-1",
            access_key_id=key_id,
            secret_access_key=secret,
            part_size_bytes=part,
            max_concurrency=args.concurrency,
        )
        raw = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            config=Config(
                s3={"addressing_style": "path"},
                max_pool_connections=max(10, 2 * args.concurrency + 2),
            ),
        )
        if server is not None:
            raw.create_bucket(Bucket=bucket)
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        ours = S3Storage(bucket, prefix, opts)
        tc = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=args.concurrency,
            use_threads=True,
        )
        n, r = len(data), args.repeat
        key = f"{prefix}/raw"

        def stream_ours() -> None:
            with ours.open_write("stream") as f:
                for off in range(0, n, 8 * MIB):
                    f.write(memoryview(data)[off : off + 8 * MIB])

        t = timed(
            {
                "ours": lambda: ours.write("blob", data),
                "put": lambda: raw.put_object(Bucket=bucket, Key=key, Body=data),
                "upload": lambda: raw.upload_fileobj(io.BytesIO(data), bucket, key, Config=tc),
                "stream": stream_ours,
            },
            r,
        )
        t_ours, t_put, t_upl, t_stream = t["ours"], t["put"], t["upload"], t["stream"]
        rows += [
            row("s3 upload", "S3Storage.write vs put_object", n, t_ours, t_put),
            row("s3 upload", "S3Storage.write vs upload_fileobj", n, t_ours, t_upl),
            row("s3 upload", "open_write(8 MiB chunks) vs upload_fileobj", n, t_stream, t_upl),
        ]

        def read_stream() -> None:
            with ours.open_read("blob") as f:
                while f.read(8 * MIB):
                    pass

        same = f"{prefix}/blob"  # downloads read the very same object

        def raw_get() -> None:
            raw.get_object(Bucket=bucket, Key=same)["Body"].read()

        def raw_download() -> None:
            raw.download_fileobj(bucket, same, io.BytesIO(), Config=tc)

        assert ours.read("blob") == data
        t = timed(
            {
                "read": lambda: ours.read("blob"),
                "open": read_stream,
                "get": raw_get,
                "download": raw_download,
            },
            r,
        )
        t_read, t_open, t_get, t_dl = t["read"], t["open"], t["get"], t["download"]
        rows += [
            row("s3 download", "S3Storage.read vs get_object", n, t_read, t_get),
            row("s3 download", "open_read (streamed) vs get_object", n, t_open, t_get),
            row("s3 download", "S3Storage.read vs download_fileobj", n, t_read, t_dl),
        ]
        ours.delete_prefix("")
        raw.delete_object(Bucket=bucket, Key=key)
        ours.close()
    finally:
        if server is not None:
            server.stop()
        if workdir is not None:
            workdir.cleanup()


def bench_fs(data: bytes, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-fs-", dir=args.fs_dir) as d:
        store = LocalStorage(Path(d) / "ours")
        raw_path = Path(d) / "raw.bin"
        n, r = len(data), args.repeat

        def raw_write() -> None:
            with open(raw_path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        def raw_read() -> bytes:
            with open(raw_path, "rb") as f:
                return f.read()

        def drop() -> None:
            store.delete("blob")
            raw_path.unlink(missing_ok=True)

        t = timed({"ours": lambda: store.write("blob", data), "raw": raw_write}, r, setup=drop)
        rows.append(row("fs write", "LocalStorage.write vs write+fsync", n, t["ours"], t["raw"]))
        store.write("blob", data)
        raw_write()
        t = timed({"ours": lambda: store.read("blob"), "raw": raw_read}, r)
        t_ours, t_raw = t["ours"], t["raw"]
        rows.append(row("fs read", "LocalStorage.read vs open().read() (cached)", n, t_ours, t_raw))


def row(group: str, what: str, nbytes: int, ours_s: float, raw_s: float) -> dict[str, Any]:
    return {
        "group": group,
        "comparison": what,
        "bytes": nbytes,
        "ours_s": round(ours_s, 4),
        "raw_s": round(raw_s, 4),
        "ours_mib_s": round(mbps(nbytes, ours_s), 1),
        "raw_mib_s": round(mbps(nbytes, raw_s), 1),
        "ratio": round(raw_s / ours_s, 3),  # ours throughput / raw throughput
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--skip-s3", action="store_true")
    p.add_argument("--skip-fs", action="store_true")
    p.add_argument("--endpoint", help="existing S3 endpoint (credentials from AWS_* env)")
    p.add_argument("--bucket", default="bench")
    p.add_argument("--fs-dir", help="directory for the fs rows (default: the temp dir)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)

    data = os.urandom(args.size_mib * MIB)  # incompressible
    rows: list[dict[str, Any]] = []
    if not args.skip_fs:
        bench_fs(data, args, rows)
    if not args.skip_s3:
        bench_s3(data, args, rows)

    print(
        f"\n{args.size_mib} MiB, median of {args.repeat}, part {args.part_mib} MiB, "
        f"concurrency {args.concurrency}, {os.cpu_count()} CPUs (client and server share them)\n"
    )
    head = f"{'group':<12} {'comparison':<46} {'ours MiB/s':>10} {'raw MiB/s':>10} {'ours/raw':>9}"
    print(head)
    print("-" * len(head))
    for x in rows:
        print(
            f"{x['group']:<12} {x['comparison']:<46} {x['ours_mib_s']:>10.1f} "
            f"{x['raw_mib_s']:>10.1f} {x['ratio']:>9.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
