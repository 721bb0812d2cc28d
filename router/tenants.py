"""Tenants: who may call the router (a key each) and what each may use, from `--tenants FILE`.

The file is a YAML list, validated whole (docs/router.md, "Tenants"): a bad file stops the router
at start with the entry and field at fault; a bad edit later keeps the table in force and logs
why. Keys are held as SHA-256 digests only, and a client's key is compared with every tenant's
in constant time (``hmac.compare_digest``, no early exit), so neither which tenant matched nor
how far a guess got shows in the timing.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscale.router.auth import key_digest

log = logging.getLogger("kvscale.router")

MAX_FILE_BYTES = 1 << 20
MAX_TENANTS = 1000
RELOAD_POLL_S = 1.0
# A name is a metric label value and part of Redis key names: short, and nothing to escape.
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_EMPTY_KEY = key_digest("")
# Where the admission gate leaves the tenant it authenticated, in the request's ASGI scope.
SCOPE_KEY = "kvscale.tenant"
_FIELDS = {"name", "api_key", "api_key_sha256", "api_key_env", "requests_per_minute",
           "tokens_per_minute", "weight", "priority"}
_KEY_FIELDS = ("api_key", "api_key_sha256", "api_key_env")


class TenantFileError(ValueError):
    """The tenants file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: bytes = b""
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None
    # The order of requests waiting in the router under --max-queue-wait (router/fair_share.py).
    weight: float = 1.0
    priority: int = 0

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class TenantTable:
    tenants: tuple[Tenant, ...]

    def match(self, key_sha256: bytes) -> Tenant | None:
        """The tenant holding the key of this digest; every entry is compared, whatever matches."""
        found = None
        for tenant in self.tenants:
            if hmac.compare_digest(tenant.key_sha256, key_sha256):
                found = tenant
        return found

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tenants]

    @property
    def limited(self) -> bool:
        return any(t.limited for t in self.tenants)


def _count(entry: dict[str, Any], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TenantFileError(f"{where}: {field} must be a positive integer (or absent: no limit), "
                              f"not {value!r}")
    return value


def _key_sha256(entry: dict[str, Any], where: str, environ: Mapping[str, str]) -> bytes:
    """The digest of the key the entry gives: in clear, as its digest, or in an environment
    variable of the router's (on Kubernetes, set from the tenant's Secret: docs/operator.md,
    "Tenants"), so the file itself holds no secret."""
    given = [field for field in _KEY_FIELDS if entry.get(field) is not None]
    if len(given) != 1:
        raise TenantFileError(f"{where}: give exactly one of {', '.join(_KEY_FIELDS)}")
    key = entry.get("api_key")
    env = entry.get("api_key_env")
    if env is not None:
        if not isinstance(env, str) or not _ENV_NAME.match(env):
            raise TenantFileError(f"{where}: api_key_env must name an environment variable "
                                  f"(letters, digits, '_'), not {env!r}")
        key = environ.get(env)
        if not key:
            raise TenantFileError(f"{where}: the environment variable {env} (api_key_env) is "
                                  "not set or empty")
        key = key.strip()
    if key is not None:
        if not isinstance(key, str) or not key or key != key.strip():
            raise TenantFileError(f"{where}: api_key must be a non-empty string without spaces "
                                  "around it")
        return key_digest(key)
    digest = entry.get("api_key_sha256")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise TenantFileError(f"{where}: api_key_sha256 must be 64 hexadecimal digits "
                              "(the SHA-256 of the key, e.g. `printf %s KEY | sha256sum`)")
    return bytes.fromhex(digest)


def _tenant(entry: Any, where: str, environ: Mapping[str, str]) -> Tenant:
    if not isinstance(entry, dict):
        raise TenantFileError(f"{where}: a tenant is a mapping with a name and a key, not {entry!r}")
    unknown = sorted(str(k) for k in entry if k not in _FIELDS)
    if unknown:
        raise TenantFileError(f"{where}: unknown field(s) {', '.join(unknown)}; the fields are "
                              f"{', '.join(sorted(_FIELDS))}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TenantFileError(f"{where}: name must be 1-63 lower-case letters, digits, '.', '_' or "
                              f"'-', starting and ending with a letter or digit, not {name!r}")
    where = f"{where} ({name})"
    key_sha256 = _key_sha256(entry, where, environ)
    if key_sha256 == _EMPTY_KEY:
        raise TenantFileError(f"{where}: the key is empty")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < 1e6:
        raise TenantFileError(f"{where}: weight must be a positive number, not {weight!r}")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 1_000_000:
        raise TenantFileError(f"{where}: priority must be an integer, not {priority!r}")
    return Tenant(name, key_sha256, _count(entry, "requests_per_minute", where),
                  _count(entry, "tokens_per_minute", where), float(weight), priority)


def parse_tenants(text: str, source: str = "the tenants file",
                  environ: Mapping[str, str] | None = None) -> TenantTable:
    """The table a tenants file's text describes; TenantFileError says what is wrong.
    ``environ``: where `api_key_env` names are looked up (None: this process's environment)."""
    import yaml

    try:
        entries = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantFileError(f"{source} is not valid YAML: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise TenantFileError(f"{source} must be a non-empty YAML list of tenants")
    if len(entries) > MAX_TENANTS:
        raise TenantFileError(f"{source} lists {len(entries)} tenants; at most {MAX_TENANTS}")
    env = os.environ if environ is None else environ
    tenants = [_tenant(entry, f"{source}, tenant #{i + 1}", env) for i, entry in enumerate(entries)]
    seen_names: set[str] = set()
    seen_keys: dict[bytes, str] = {}
    for tenant in tenants:
        if tenant.name in seen_names:
            raise TenantFileError(f"{source}: the name {tenant.name!r} is given twice")
        if tenant.key_sha256 in seen_keys:
            raise TenantFileError(f"{source}: {seen_keys[tenant.key_sha256]!r} and "
                                  f"{tenant.name!r} have the same key")
        seen_names.add(tenant.name)
        seen_keys[tenant.key_sha256] = tenant.name
    return TenantTable(tuple(tenants))


def load_tenants(path: str | Path) -> TenantTable:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TenantFileError(f"cannot read the tenants file {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise TenantFileError(f"the tenants file {path} is over {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise TenantFileError(f"the tenants file {path} is not UTF-8") from None
    return parse_tenants(text, str(path))


class TenantFile:
    """The table from a file, read again when the file changes (its mtime, size or inode, looked
    at most once per ``poll_s`` when the table is asked for). A file that no longer loads leaves
    the table in force; the error is logged once per change of the file."""

    def __init__(self, path: str | Path, poll_s: float = RELOAD_POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._clock = clock
        self._stamp = self._stat()
        self.table = load_tenants(self.path)  # at start, an error stops the router
        self._polled = clock()
        self.reloads = 0  # tables taken after the first (tests and logs)
        self.on_reload: list[Callable[[TenantTable], None]] = []

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def current(self) -> TenantTable:
        now = self._clock()
        if now - self._polled >= self.poll_s:
            self._polled = now
            self.poll()
        return self.table

    def poll(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            table = load_tenants(self.path)
        except TenantFileError as exc:
            log.error("tenants file changed but cannot be used; keeping the %d tenants in force: %s",
                      len(self.table.tenants), exc)
            return
        self.table = table
        self.reloads += 1
        log.info("tenants reloaded from %s: %s", self.path, ", ".join(table.names))
        for callback in self.on_reload:
            callback(table)
