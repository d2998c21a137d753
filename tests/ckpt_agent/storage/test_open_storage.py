"""URL schemes, entry points, options from the environment, error taxonomy, import hygiene."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.storage import (
    ENTRY_POINT_GROUP,
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
    StorageOptions,
    open_storage,
)
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import ENV_VARS, parse_size

AGENT = Path(__file__).resolve().parents[3] / "agent"


def test_scheme_dispatch(tmp_path: Path) -> None:
    from ckpt_agent.storage.s3 import S3Storage

    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(tmp_path.as_uri()), LocalStorage)
    s3 = open_storage("s3://my-bucket/runs/r1/", StorageOptions(region="eu-west-1"))
    assert isinstance(s3, S3Storage)
    assert (s3.bucket, s3.root, s3.url) == ("my-bucket", "runs/r1", "s3://my-bucket/runs/r1")
    assert s3.client.meta.region_name == "eu-west-1"
    root = open_storage("s3://only-bucket", StorageOptions(region="us-east-1"))
    assert root.url == "s3://only-bucket"
    for bad in ("s3:///prefix", "s3://b/p?x=1"):
        with pytest.raises(ValueError):
            open_storage(bad)
    with pytest.raises(ValueError, match=ENTRY_POINT_GROUP):
        open_storage("gs://bucket/x")
    with pytest.raises(ValueError):
        open_storage("")


def test_s3_client_settings_follow_options() -> None:
    from ckpt_agent.storage.s3 import S3Storage

    s = S3Storage(
        "b",
        "p",
        StorageOptions(endpoint_url="http://127.0.0.1:1", region="us-east-1", read_timeout_s=7),
    )
    cfg: Any = s.client.meta.config
    assert s.client.meta.endpoint_url == "http://127.0.0.1:1"
    assert cfg.s3["addressing_style"] == "path"  # custom endpoint → path style by default
    assert cfg.read_timeout == 7
    assert cfg.retries["total_max_attempts"] == 1  # we retry, not botocore
    aws = S3Storage("b", "", StorageOptions(region="us-east-1"))
    aws_cfg: Any = aws.client.meta.config
    assert aws_cfg.s3["addressing_style"] == "auto"
    with pytest.raises(ValueError, match="5 MiB"):
        S3Storage("b", "", StorageOptions(part_size_bytes=1024 * 1024))


def test_options_from_env() -> None:
    env = {
        "CKPT_S3_ENDPOINT_URL": "http://minio.storage:9000",
        "CKPT_S3_REGION": "eu-central-1",
        "CKPT_S3_PATH_STYLE": "false",
        "CKPT_S3_SSE": "aws:kms",
        "CKPT_S3_KMS_KEY_ID": "alias/ckpt",
        "CKPT_S3_PART_SIZE": "64MiB",
        "CKPT_S3_MAX_CONCURRENCY": "8",
        "CKPT_S3_MAX_ATTEMPTS": "5",
        "CKPT_S3_BACKOFF_BASE_S": "0.1",
        "CKPT_S3_CONNECT_TIMEOUT_S": "2.5",
        "CKPT_S3_READ_TIMEOUT_S": "30",
        "CKPT_S3_LIST_PAGE_SIZE": "500",
        "CKPT_S3_ACCESS_KEY_ID": "AKIA-from-secret",
        "CKPT_S3_SECRET_ACCESS_KEY": "s3cr3t",
        "CKPT_S3_CHECKSUMS": "when_required",
        "CKPT_FS_FSYNC": "0",
        "CKPT_S3_PROFILE": "",  # empty = unset
    }
    o = StorageOptions.from_env(env)
    assert o.endpoint_url == "http://minio.storage:9000"
    assert (o.region, o.path_style, o.use_path_style) == ("eu-central-1", False, False)
    assert (o.sse, o.kms_key_id) == ("aws:kms", "alias/ckpt")
    assert o.part_size_bytes == 64 * 1024 * 1024
    assert (o.max_concurrency, o.max_attempts, o.list_page_size) == (8, 5, 500)
    assert (o.backoff_base_s, o.connect_timeout_s, o.read_timeout_s) == (0.1, 2.5, 30.0)
    assert (o.access_key_id, o.secret_access_key) == ("AKIA-from-secret", "s3cr3t")
    assert o.checksums == "when_required" and o.fsync is False and o.profile is None
    assert "s3cr3t" not in repr(o) and "AKIA" not in repr(o)
    assert StorageOptions.from_env({}) == StorageOptions()
    assert StorageOptions.from_env({}, max_attempts=7).max_attempts == 7
    assert set(ENV_VARS) >= set(env)


def test_options_to_env_round_trip() -> None:
    """What a child process (the validator's loader) is given opens the same storage."""
    o = StorageOptions(
        endpoint_url="http://minio.storage:9000",
        region="eu-central-1",
        path_style=True,
        sse="aws:kms",
        kms_key_id="alias/ckpt",
        part_size_bytes=48 * 1024 * 1024,
        max_attempts=9,
        backoff_base_s=0.125,
        read_timeout_s=7.5,
        access_key_id="AKIA",
        secret_access_key="s3cr3t",
        fsync=False,
    )
    base = {"PATH": "/bin", "CKPT_S3_PROFILE": "stale", "CKPT_S3_MAX_ATTEMPTS": "1"}
    env = o.to_env(base)
    assert StorageOptions.from_env(env) == o
    assert env["PATH"] == "/bin" and "CKPT_S3_PROFILE" not in env  # the base's own are replaced
    assert (env["CKPT_S3_MAX_ATTEMPTS"], env["CKPT_FS_FSYNC"]) == ("9", "false")
    assert StorageOptions.from_env(StorageOptions().to_env({})) == StorageOptions()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CKPT_S3_MAX_ATTEMPTS": "three"}, "CKPT_S3_MAX_ATTEMPTS"),
        ({"CKPT_S3_PATH_STYLE": "maybe"}, "CKPT_S3_PATH_STYLE"),
        ({"CKPT_S3_PART_SIZE": "16 potatoes"}, "CKPT_S3_PART_SIZE"),
        ({"CKPT_S3_SSE": "rot13"}, "sse must be"),
        ({"CKPT_S3_KMS_KEY_ID": "k"}, "aws:kms"),
        ({"CKPT_S3_MAX_ATTEMPTS": "0"}, "max_attempts"),
        ({"CKPT_S3_LIST_PAGE_SIZE": "5000"}, "list_page_size"),
        ({"CKPT_S3_ACCESS_KEY_ID": "only-half"}, "both"),
    ],
)
def test_bad_options_say_which(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StorageOptions.from_env(env)


def test_parse_size() -> None:
    assert parse_size("5242880") == 5 * 1024 * 1024
    assert parse_size("5MiB") == parse_size("5m") == parse_size("5 MB") == 5 * 1024 * 1024
    assert parse_size("1g") == 1024**3


def test_open_storage_reads_env_when_no_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CKPT_S3_REGION", "us-east-1")
    monkeypatch.setenv("CKPT_S3_MAX_ATTEMPTS", "4")
    s = open_storage("s3://b/p")
    assert s.options.max_attempts == 4  # type: ignore[attr-defined]
    assert s.client.meta.endpoint_url == "http://127.0.0.1:9"  # type: ignore[attr-defined]


def test_third_party_backend_through_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real installed-distribution entry point (a dist-info on sys.path)."""
    (tmp_path / "memstore_plugin.py").write_text(
        textwrap.dedent(
            """
            from ckpt_agent.storage.fs import LocalStorage

            class MemLike(LocalStorage):
                @classmethod
                def from_url(cls, url, options=None):
                    return cls("/tmp/memlike-" + url.split("://", 1)[1], options)

            def factory(url, options):
                return LocalStorage("/tmp/factory-" + url.split("://", 1)[1], options)
            """
        )
    )
    dist = tmp_path / "memstore_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: memstore-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmem = memstore_plugin:MemLike\nfac = memstore_plugin:factory\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    s = open_storage("mem://abc")
    assert type(s).__name__ == "MemLike" and s.url.endswith("/tmp/memlike-abc")
    f = open_storage("fac://xyz")
    assert isinstance(f, LocalStorage) and f.url.endswith("/tmp/factory-xyz")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    script = f"import sys; sys.path.insert(0, {str(AGENT)!r})\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )


def test_missing_boto3_gives_a_readable_error() -> None:
    proc = _python(
        """
        sys.modules["boto3"] = None  # as if not installed
        from ckpt_agent.storage import open_storage
        open_storage("/tmp/x")  # fs works without boto3
        try:
            open_storage("s3://bucket/prefix")
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "IMPORT-ERROR: s3:// storage needs boto3: `pip install boto3`" in proc.stdout


def test_import_hygiene() -> None:
    """No torch anywhere; fs never loads s3/boto3; s3 never loads fs."""
    proc = _python(
        """
        import ckpt_agent.storage, ckpt_agent.storage.fs
        print(sorted(m for m in ("torch", "boto3", "ckpt_agent.storage.s3") if m in sys.modules))
        import ckpt_agent.storage.s3
        print(sorted(m for m in ("torch", "ckpt_agent.storage.fs") if m in sys.modules))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "['ckpt_agent.storage.fs']"]
    proc = _python(
        """
        import ckpt_agent.storage.s3
        print("ckpt_agent.storage.fs" in sys.modules, "torch" in sys.modules)
        """
    )
    assert proc.stdout.strip() == "False False", proc.stderr


def _client_error(code: str, status: int, op: str = "PutObject") -> Any:
    from botocore.exceptions import ClientError

    response: Any = {
        "Error": {"Code": code, "Message": f"msg-{code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, op)


@pytest.fixture(scope="module")
def offline_s3() -> Any:
    """An S3Storage that is never asked to connect (client creation costs ~0.5 s)."""
    from ckpt_agent.storage.s3 import S3Storage

    return S3Storage("bkt", "pre", StorageOptions(region="us-east-1"))


@pytest.mark.parametrize(
    ("code", "status", "kind", "hint"),
    [
        ("SlowDown", 503, RetryableStorageError, ""),
        ("InternalError", 500, RetryableStorageError, ""),
        ("ServiceUnavailable", 503, RetryableStorageError, ""),
        ("RequestTimeout", 400, RetryableStorageError, ""),
        ("Throttling", 400, RetryableStorageError, ""),
        ("Whatever", 502, RetryableStorageError, ""),
        ("TooMany", 429, RetryableStorageError, ""),
        ("AccessDenied", 403, PermanentStorageError, "s3:PutObject"),
        ("InvalidAccessKeyId", 403, PermanentStorageError, "AWS_ACCESS_KEY_ID"),
        ("SignatureDoesNotMatch", 403, PermanentStorageError, "secret access key"),
        ("403", 403, PermanentStorageError, "not allowed"),
        ("NoSuchBucket", 404, PermanentStorageError, "create it"),
        ("KeyTooLongError", 400, PermanentStorageError, "shorter"),
        ("AuthorizationHeaderMalformed", 400, PermanentStorageError, "CKPT_S3_REGION"),
        ("NoSuchKey", 404, NotFoundError, ""),
        ("404", 404, NotFoundError, ""),
    ],
)
def test_error_classification(
    offline_s3: Any, code: str, status: int, kind: type, hint: str
) -> None:
    err = offline_s3.classify(_client_error(code, status), "PutObject", "k")
    assert type(err) is kind
    assert "s3://bkt/pre/k" in str(err) and hint in str(err)
    assert isinstance(err, StorageError)
    assert err.code == ("AccessDenied" if code == "403" else code)  # what callers decide on


def test_network_errors_are_retryable_and_bugs_are_not_classified() -> None:
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    from ckpt_agent.storage.s3 import S3Storage

    s = S3Storage("b", "", StorageOptions(region="us-east-1"))
    for e in (
        EndpointConnectionError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        ConnectTimeoutError(endpoint_url="http://x"),
        ConnectionResetError(104, "reset"),
    ):
        assert isinstance(s.classify(e, "GetObject"), RetryableStorageError)
    creds = s.classify(NoCredentialsError(), "PutObject")
    assert isinstance(creds, PermanentStorageError) and "AWS_ACCESS_KEY_ID" in str(creds)
    assert s.classify(KeyError("bug"), "PutObject") is None


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    from ckpt_agent.storage.s3 import S3Storage

    s = S3Storage(
        "b", "", StorageOptions(region="us-east-1", backoff_base_s=1.0, backoff_max_s=8.0)
    )
    for attempt, (lo, hi) in enumerate([(0.5, 1), (1, 2), (2, 4), (4, 8), (4, 8)], start=1):
        samples = [s.bucket_client.backoff_s(attempt) for _ in range(200)]
        assert lo <= min(samples) and max(samples) <= hi
        assert max(samples) - min(samples) > (hi - lo) / 4  # jittered, not fixed
