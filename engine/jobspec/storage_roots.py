"""Which storage a job may touch: one root-matching rule for the service and the ranks.

A tenant's job spec names paths and buckets (checkpoint.path, data.path, data.tokenizer,
model.init_from, ...). The service decides at submission whether each lies under the roots its
tenant may use (service/storage_policy.py) and hands the decision to the job's processes in
`ELASTRON_STORAGE_ROOTS`; where storage is opened (`open_storage`, the rank's start) the same
functions here check again, so a spec that slipped past the service, or a path composed later,
still cannot leave the roots. No service import: the engine must run without the service.

Matching is by whole path segments after normalisation: local paths through realpath (so `..`
and symlinks resolve to where they really lead), `file://` as local, `s3://bucket/prefix`
without trailing slashes; `s3://b/p` is never under `s3://b/prefix-other` nor the reverse. A
location that cannot be normalised (an s3 key with `.`/`..`/empty segments, another scheme) is
under no root.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

ENV_STORAGE_ROOTS = "ELASTRON_STORAGE_ROOTS"
Access = Literal["read", "write"]


class StorageOutsideRoots(PermissionError):
    """A location outside the roots this process may use; the message names both."""


def normalize(location: str) -> tuple[str, ...] | None:
    """('local', seg, ...) or ('s3', bucket, seg, ...); None when it cannot be matched safely."""
    if not isinstance(location, str) or not location.strip():
        return None
    if "://" not in location:
        try:
            path = os.path.realpath(os.path.expanduser(location))
        except (ValueError, OSError):  # a NUL byte, a symlink loop: nothing to match
            return None
        return ("local", *[p for p in path.split("/") if p])
    scheme, _, rest = location.partition("://")
    scheme = scheme.lower()
    if scheme == "file":
        rest = unquote(rest)
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        return normalize(rest) if rest else None
    if scheme != "s3":
        return None
    try:
        parts = urlsplit(location)
    except ValueError:
        return None
    if not parts.netloc or "@" in parts.netloc or parts.query or parts.fragment:
        return None
    segments = parts.path.split("/")[1:] if parts.path else []
    while segments and segments[-1] == "":
        segments.pop()  # trailing slashes
    if any(s in ("", ".", "..") for s in segments):
        return None
    return ("s3", parts.netloc, *segments)


def is_within(location: str, root: str) -> bool:
    """True when `location` is `root` or below it, segment by segment."""
    loc, base = normalize(location), normalize(root)
    return loc is not None and base is not None and loc[: len(base)] == base


@dataclass(frozen=True)
class StorageRoots:
    """The roots one job (or export) may use: write roots are readable too; `read` adds roots
    that are only read (an operator's shared datasets); `endpoints` are the S3 endpoint URLs it
    may name (empty: none besides the default chain)."""

    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = field(default=())

    def allows(self, location: str, access: Access) -> bool:
        roots = self.write if access == "write" else (*self.write, *self.read)
        return any(is_within(location, r) for r in roots)

    def allows_endpoint(self, url: str) -> bool:
        return normalize_endpoint(url) in {normalize_endpoint(e) for e in self.endpoints}

    def describe(self, access: Access) -> str:
        roots = self.write if access == "write" else (*self.write, *self.read)
        return ", ".join(roots) if roots else "(none)"

    def to_env(self) -> str:
        return json.dumps(
            {"write": list(self.write), "read": list(self.read), "endpoints": list(self.endpoints)},
            separators=(",", ":"),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StorageRoots | None:
        """The roots the service gave this process; None when it gave none (a local run, an admin's job)."""
        text = (os.environ if environ is None else environ).get(ENV_STORAGE_ROOTS)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                tuple(data.get("write") or ()),
                tuple(data.get("read") or ()),
                tuple(data.get("endpoints") or ()),
            )
        except (ValueError, TypeError, AttributeError):
            # Unreadable: confine to nothing rather than to everything.
            return cls()


def normalize_endpoint(url: str) -> str:
    """scheme://host[:port] in lower case, no trailing slash: how endpoint URLs are compared."""
    try:
        parts = urlsplit(url.strip()) if isinstance(url, str) else None
    except ValueError:
        parts = None
    if parts is None or not parts.scheme or not parts.netloc:
        return f"invalid:{url!r}"
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def _tokenizer_location(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    kind, sep, path = value.partition(":")
    return path.strip() if sep and kind in ("hf", "sentencepiece") and path.strip() else None


def spec_locations(spec: Mapping[str, Any]) -> Iterator[tuple[str, str, Access]]:
    """(field, location, access) for every storage location a job spec names, read from the raw
    submitted object (before any validation, so nothing is read first). `resume_from: job:ID` is
    not a location (the service resolves it among the caller's jobs)."""

    def section(name: str) -> Mapping[str, Any]:
        value = spec.get(name) if isinstance(spec, Mapping) else None
        return value if isinstance(value, Mapping) else {}

    checkpoint, data, model = section("checkpoint"), section("data"), section("model")
    lora = model.get("lora") if isinstance(model.get("lora"), Mapping) else {}
    candidates: list[tuple[str, Any, Access]] = [
        ("checkpoint.path", checkpoint.get("path"), "write"),
        ("checkpoint.resume_from", checkpoint.get("resume_from"), "read"),
        ("data.path", data.get("path"), "read"),
        ("data.cache_dir", data.get("cache_dir"), "write"),
        ("data.tokenizer", _tokenizer_location(data.get("tokenizer")), "read"),
        ("model.init_from", model.get("init_from"), "read"),
        ("model.lora.init_from", lora.get("init_from"), "read"),
    ]
    blend = data.get("blend")
    if isinstance(blend, list):
        for i, member in enumerate(blend):
            if isinstance(member, (list, tuple)) and len(member) == 2:
                candidates.append((f"data.blend[{i}]", member[1], "read"))
    for name, value, access in candidates:
        if value is None:
            continue
        if name == "checkpoint.resume_from" and isinstance(value, str) and value.startswith("job:"):
            continue
        yield name, value if isinstance(value, str) else repr(value), access


def spec_problems(spec: Mapping[str, Any], roots: StorageRoots) -> list[tuple[str, str]]:
    """(field, message) for each location or endpoint of `spec` outside `roots`."""
    problems = []
    for name, location, access in spec_locations(spec):
        if not roots.allows(location, access):
            problems.append((name, outside_message(name, location, roots, access)))
    checkpoint = spec.get("checkpoint") if isinstance(spec, Mapping) else None
    endpoint = checkpoint.get("endpoint_url") if isinstance(checkpoint, Mapping) else None
    if endpoint is not None and not roots.allows_endpoint(endpoint):
        allowed = (
            ", ".join(roots.endpoints) if roots.endpoints else "none (leave it unset: the default endpoint)"
        )
        problems.append(
            (
                "checkpoint.endpoint_url",
                f"checkpoint.endpoint_url {endpoint!r} is not one of the S3 endpoints the operator allows "
                f"(ELASTRON_ALLOWED_ENDPOINTS): {allowed}",
            )
        )
    return problems


def outside_message(name: str, location: str, roots: StorageRoots, access: Access) -> str:
    verb = "write" if access == "write" else "read"
    return (
        f"{name} {location!r} is outside the storage this tenant may {verb}: use a location under "
        f"{roots.describe(access)} (an admin grants more with `elastron tenants set-storage`)"
    )


def require_within(
    location: str, access: Access = "read", what: str = "storage", roots: StorageRoots | None = None
) -> None:
    """Raise StorageOutsideRoots when this process was given roots and `location` is outside
    them; nothing when it was given none."""
    roots = StorageRoots.from_env() if roots is None else roots
    if roots is not None and not roots.allows(location, access):
        raise StorageOutsideRoots(outside_message(what, location, roots, access))


def check_spec_within(spec: Mapping[str, Any], roots: StorageRoots | None = None) -> None:
    """At a rank's or driver's start: every location of the spec as run within the given roots."""
    roots = StorageRoots.from_env() if roots is None else roots
    if roots is None:
        return
    problems = spec_problems(spec, roots)
    if problems:
        raise StorageOutsideRoots("; ".join(m for _, m in problems))


def joined(roots: Iterable[str]) -> tuple[str, ...]:
    """Roots without duplicates, in order."""
    return tuple(dict.fromkeys(r for r in roots if r))
