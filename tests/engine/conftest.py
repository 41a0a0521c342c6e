"""Shared engine-test fixtures: a real S3-compatible server (moto's standalone server, in its own process).

The server is a separate process on loopback, as docs/architecture.md ("Conventions") asks of tests that need a server: the
code under test talks HTTP through botocore exactly as it would to AWS, with retries, multipart and
ranged GETs on the wire, rather than through an in-process mock of boto3.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.launcher import free_port

_DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "elastron-test",
    "AWS_SECRET_ACCESS_KEY": "elastron-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _moto_server_binary() -> str:
    candidate = Path(sys.executable).parent / "moto_server"
    found = str(candidate) if candidate.exists() else shutil.which("moto_server")
    if not found:
        raise RuntimeError("moto_server not found: install the dev extras (pip install -e '.[dev]')")
    return found


def _answers(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server running in a subprocess for the whole test session."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="moto-server-", suffix=".log", delete=False)
    env = {**os.environ, **_DUMMY_CREDENTIALS}
    proc = subprocess.Popen(
        [_moto_server_binary(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not _answers(port):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer on port {port} within 30 s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Point boto3's default chain at the test server with dummy credentials, for one test only.

    Profiles, config files and instance metadata are cut off so a developer's real AWS setup can
    neither leak into the test nor be used by it.
    """
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_REGION",
        "AWS_ENDPOINT_URL_S3",
        "AWS_RETRY_MODE",
        "AWS_MAX_ATTEMPTS",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in _DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    """A fresh, empty bucket on the test server (the env points boto3 at it)."""
    import boto3

    name = f"elastron-test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name
