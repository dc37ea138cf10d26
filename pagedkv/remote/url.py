"""Remote-tier URLs: parse the forms redis-py speaks, and print them without secrets.

Forms: ``redis://[user[:password]@]host[:port][/db]``, ``rediss://`` (TLS) with the
same parts, ``unix:///path/redis.sock[?db=N]``, and a cluster as
``redis+cluster://[user[:password]@]host1:port1,host2:port2`` (``rediss+cluster://``
for TLS). A password comes from the URL or, when the URL has none, from an
environment variable; it is kept out of every ``str``, ``repr`` and message here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import PagedKVError

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
# Query keys passed on to redis-py (TLS settings of rediss://); anything else is refused.
TLS_KEYS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
SECRET_QUERY_KEYS = ("password",)
REDACTED = "***"


@dataclass(frozen=True, slots=True)
class RemoteURL:
    """A parsed remote URL; ``password`` never appears in ``str``/``repr`` (see ``redacted``)."""

    scheme: str  # one of SCHEMES
    hosts: tuple[tuple[str, int], ...] = ()  # (host, port) of each node; empty for unix://
    db: int = 0  # database number (0 for a cluster, which has only database 0)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    unix_path: str | None = None  # socket path of unix://
    tls: dict[str, str] = field(default_factory=dict)  # TLS settings from the query string
    password_from_env: bool = False  # whether the password came from the environment

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis Cluster."""
        return self.scheme.endswith("+cluster")

    @property
    def secure(self) -> bool:
        """Whether connections use TLS."""
        return self.scheme.startswith("rediss")

    @property
    def redacted(self) -> str:
        """The URL as it may be printed: the password (if any) replaced by ``***``."""
        auth = ""
        if self.username or self.password:
            auth = (self.username or "") + (f":{REDACTED}" if self.password and not self.password_from_env
                                            else "") + "@"
        if self.scheme == "unix":
            text = f"unix://{auth}{self.unix_path}"
            return text + (f"?db={self.db}" if self.db else "")
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.hosts)
        tail = "" if self.cluster else f"/{self.db}"
        return f"{self.scheme}://{auth}{hosts}{tail}"

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted!r})"


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` (and its URL-quoted form) replaced by ``***``."""
    if not secret:
        return text
    from urllib.parse import quote

    for form in {secret, quote(secret, safe=""), quote(secret)}:
        text = text.replace(form, REDACTED)
    return text


def parse_url(url: str, password_env: str | None = "PAGEDKV_REMOTE_PASSWORD",
              cluster: bool = False) -> RemoteURL:
    """Parse a remote URL; ``cluster`` forces the cluster client for a ``redis://`` URL.

    Params:
        url: one of the forms in this module's docstring.
        password_env: an environment variable read for the password when the URL
            has none (None: never read the environment).
        cluster: treat ``redis://h1:p1,h2:p2`` (or one node) as a cluster's seed nodes.
    Raises:
        PagedKVError naming what is wrong, never echoing a password.
    """
    if not isinstance(url, str) or not url:
        raise PagedKVError("remote must be a URL string such as redis://host:6379/0")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise PagedKVError(f"remote URL scheme must be one of {', '.join(s + '://' for s in SCHEMES)}; "
                           f"got {scheme + '://' if sep else 'no scheme'}")
    if cluster and scheme in ("redis", "rediss"):
        scheme += "+cluster"
    if cluster and scheme == "unix":
        raise PagedKVError("a Redis Cluster is reached over TCP, not a unix socket")
    # urlsplit does not take several hosts: split the authority ourselves.
    authority, path, query = _split(rest)
    username, password = None, None
    if "@" in authority:
        auth, authority = authority.rsplit("@", 1)
        user, has_pw, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw and pw else None
    params = dict(parse_qsl(query, keep_blank_values=True))
    secret = password or params.get("password")
    for key in params:
        if key not in TLS_KEYS + ("db",) + SECRET_QUERY_KEYS:
            raise PagedKVError(f"remote URL option {key!r} is not supported (known: db, password, "
                               f"{', '.join(TLS_KEYS)})")
    if params.get("password"):
        password = params["password"]
    tls = {key: params[key] for key in TLS_KEYS if key in params}
    if tls and not scheme.startswith("rediss"):
        raise PagedKVError("TLS options need a rediss:// URL")
    from_env = False
    if password is None and password_env and os.environ.get(password_env):
        password, from_env = os.environ[password_env], True
    try:
        if scheme == "unix":
            if authority and authority != "localhost":
                raise PagedKVError("unix:// URLs take a path: unix:///path/to/redis.sock")
            if not path or path == "/":
                raise PagedKVError("unix:// URL has no socket path")
            db = _db(params.get("db", "0"))
            return RemoteURL(scheme, (), db, username, password, unquote(path), tls, from_env)
        hosts = tuple(_host_port(part) for part in authority.split(","))
        db_text = path.strip("/") or params.get("db", "0")
        db = _db(db_text)
        if scheme.endswith("+cluster") and db:
            raise PagedKVError("a Redis Cluster has only database 0")
        if not scheme.endswith("+cluster") and len(hosts) != 1:
            raise PagedKVError("several hosts need a cluster URL: redis+cluster://h1:p1,h2:p2")
        return RemoteURL(scheme, hosts, db, username, password, None, tls, from_env)
    except PagedKVError as exc:
        raise PagedKVError(redact(str(exc), secret)) from None


def _split(rest: str) -> tuple[str, str, str]:
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
    authority, slash, path = rest.partition("/")
    return authority, slash + path, query


def _host_port(part: str) -> tuple[str, int]:
    if not part:
        raise PagedKVError("remote URL has an empty host")
    parsed = urlsplit(f"//{part}")
    try:
        port = parsed.port
    except ValueError:
        raise PagedKVError(f"remote URL port of {part!r} is not a number in 1..65535") from None
    host = parsed.hostname
    if not host:
        raise PagedKVError(f"remote URL host {part!r} is empty")
    return host, port or DEFAULT_PORT


def _db(text: str) -> int:
    if not text.isdigit() or int(text) > 1 << 16:
        raise PagedKVError(f"remote URL database {text!r} is not a number")
    return int(text)
