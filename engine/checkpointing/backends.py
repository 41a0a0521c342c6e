"""Pick a checkpoint storage backend from a URI: the one module that knows every backend.

It sits above the interface (`storage.py`) and the backends (`local_storage.py`, and
`s3_storage.py`, imported only for an s3:// URI since boto3 is an optional dependency of the
engine), so no backend imports the factory back.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from engine.checkpointing.local_storage import LocalStorage
from engine.checkpointing.storage import Storage
from engine.jobspec.storage_roots import require_within


def _redact(uri: str) -> str:
    """The URI with any user:password@ part masked, fit for an error message."""
    scheme, sep, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    if sep and "@" in authority:
        return f"{scheme}://***@{authority.rsplit('@', 1)[1]}{slash}{path}"
    return uri


def open_storage(uri: str, *, endpoint_url: str | None = None, region: str | None = None) -> Storage:
    """A plain path or file:// URI -> LocalStorage; s3://bucket[/prefix] -> S3Storage (imported
    only then: boto3 is an optional dependency of the engine).

    S3 credentials come from boto3's chain (env, config files, roles), never from the URI.
    A process the service started with storage roots (ELASTRON_STORAGE_ROOTS, engine/jobspec/storage_roots.py)
    opens nothing outside them: StorageOutsideRoots (a PermissionError).
    """
    accepted = "accepted forms: a local path, file:///abs/path (or file://rel/path), s3://bucket[/prefix]"
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"checkpoint storage URI {uri!r} is empty; {accepted}")
    require_within(uri, "read", "storage location")
    if "://" not in uri:
        return LocalStorage(Path(uri))
    shown = _redact(uri)
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "file":
        rest = unquote(uri[len("file://") :])
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise ValueError(f"checkpoint storage URI {uri!r} has no path; {accepted}")
        return LocalStorage(Path(rest))
    if scheme == "s3":
        parts = urlsplit(uri)
        if "@" in parts.netloc:
            raise ValueError(
                f"checkpoint storage URI {shown!r} carries credentials; give them through the AWS "
                f"environment or config files instead; {accepted}"
            )
        if not parts.netloc:
            raise ValueError(f"checkpoint storage URI {shown!r} has no bucket; {accepted}")
        if parts.query or parts.fragment:
            raise ValueError(
                f"checkpoint storage URI {shown!r} must not have a query or fragment; {accepted}"
            )
        from engine.checkpointing.s3_storage import S3Storage

        return S3Storage(parts.netloc, parts.path.strip("/"), endpoint_url=endpoint_url, region=region)
    raise ValueError(f"unsupported checkpoint storage URI {shown!r}; {accepted}")
