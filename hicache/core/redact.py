"""One redactor for every output path: CLI output and errors, logs, REST.

Two layers, both applied by ``Redactor.text``:

* patterns: a password in a URL's userinfo or in a secret-looking query
  option (``?password=``, ``ssl_password=``, ``token=``) becomes ``***``,
  wherever a URL appears in the text, with or without ``://``;
* known secrets: the configured values themselves (the storage URL's
  password, ``service.admin_token``, the admin token file's contents,
  ``storage.auth_key``) are replaced wherever they appear, so an error that
  quotes a fragment of one (``Port could not be cast to integer value as
  'Pa55'``) does not leak it either.
"""
from __future__ import annotations
import logging
import re
from typing import Any, Iterable, Mapping
import threading
import time
from collections import OrderedDict
from typing import Callable
from hicache.core.errors import InvalidArgument


REDACTED = "***"
MIN_SECRET_CHARS = 4

# Query options that carry secrets: redis-py takes ``?password=`` (and
# ``ssl_password=``) from the query string as readily as from the userinfo.
# In free text a value ends at whitespace or a quote (the text goes on); in a URL given
# alone it ends only at the next option: a password may hold '#' or a space.
_SECRET_QUERY = re.compile(r"([?&;][^=&#\s]*(?:pass|secret|token|key)[^=&#\s]*=)[^&\s'\"]*", re.IGNORECASE)
_SECRET_QUERY_IN_URL = re.compile(r"([?&;][^=&#\s]*(?:pass|secret|token|key)[^=&#\s]*=)[^&]*", re.IGNORECASE)
_URLISH = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_TOKENS = re.compile(r"[:/@?&=#,;\[\]]+")
# Config keys whose values are secrets (their whole value), and URL-valued keys.
SECRET_KEYS = (("service", "admin_token"), ("storage", "auth_key"))
URL_KEYS = (("storage", "url"),)


def redact_url(url: str) -> str:
    """``scheme://user:***@host...?password=***`` for a URL carrying a password
    (userinfo or query option); other URLs unchanged. Also handles text that
    lacks ``://`` (a mistyped URL) and a ``user:password`` with no host."""
    if not isinstance(url, str):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        rest = _SECRET_QUERY_IN_URL.sub(r"\1" + REDACTED, url)
        userinfo, at, hosts = rest.rpartition("@")
        if not at:
            return rest
        head, colon, _ = userinfo.rpartition(":")  # whatever follows the last ':' may be a password
        return f"{head}{colon}{REDACTED}@{hosts}" if colon else f"{REDACTED}@{hosts}"
    rest = _SECRET_QUERY_IN_URL.sub(r"\1" + REDACTED, rest)
    # The userinfo ends at the last '@', even past a '/', '?' or '#': a password
    # may hold them unencoded (``redis://:pa/ss@h``), and cutting it at the
    # first '/' would show its tail. (An '@' in a query of a URL with a port
    # then hides a bit too much; never too little.)
    userinfo, at, after = rest.rpartition("@")
    if at:
        if ":" in userinfo:
            return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{REDACTED}@{after}"
        return f"{scheme}{sep}{rest}"  # ``user@host``: no password
    netloc, slash, path = rest.partition("/")
    # ``redis://user:Pa55`` (the @host forgotten): a "port" that is no
    # number may be a password.
    host, colon, port = netloc.rpartition(":")
    if colon and port and not port.isdigit() and not host.endswith("]") and "," not in netloc:
        netloc = f"{host}:{REDACTED}"
    return f"{scheme}{sep}{netloc}{slash}{path}"


def url_secrets(url: str) -> set[str]:
    """The fragments of ``url`` that ``redact_url`` hides (to find them quoted elsewhere)."""
    if not isinstance(url, str):
        return set()
    kept = set(_TOKENS.split(redact_url(url)))
    return {t for t in _TOKENS.split(url) if t and t not in kept}


def error_text(e: BaseException, url: str = "") -> str:
    """``Type: message`` of a library's exception (redis-py's URL parser quotes
    what it took for a port: a piece of an unencoded password), with ``url``'s
    secrets redacted, and any quoted piece of them, however short."""
    text = Redactor(url_secrets(url)).text(f"{type(e).__name__}: {e}")
    for piece in sorted(url_secrets(url), key=len, reverse=True):
        for q in ("'", '"'):
            text = text.replace(f"{q}{piece}{q}", f"{q}{REDACTED}{q}")
    return text


class Redactor:
    """Replaces secrets in text. Cheap to build; ``add`` more secrets as they are resolved.

    Known secrets shorter than ``MIN_SECRET_CHARS`` are covered by the patterns
    only: replacing every occurrence of a two-letter string would mangle the text
    and tell an observer which letters the secret holds.
    """

    def __init__(self, secrets: Iterable[str] = ()):
        self._secrets: list[str] = []
        for s in secrets:
            self.add(s)

    def add(self, secret: Any) -> None:
        """Treat ``secret`` (and its stripped form) as a secret from now on. Mutates."""
        if not isinstance(secret, str):
            return
        for s in {secret, secret.strip()}:
            if len(s) >= MIN_SECRET_CHARS and s not in self._secrets:
                self._secrets.append(s)
        self._secrets.sort(key=len, reverse=True)  # longest first: a secret may contain another

    def add_url(self, url: Any) -> None:
        for s in url_secrets(url) if isinstance(url, str) else ():
            self.add(s)

    def add_config_data(self, data: Mapping[str, Any]) -> None:
        """Add the secrets of raw (unvalidated) configuration data ``{section: {key: value}}``."""
        for keys, add in ((SECRET_KEYS, self.add), (URL_KEYS, self.add_url)):
            for section, key in keys:
                sec = data.get(section) if isinstance(data, Mapping) else None
                if isinstance(sec, Mapping):
                    add(sec.get(key))

    @classmethod
    def from_config_data(cls, data: Mapping[str, Any]) -> "Redactor":
        r = cls()
        r.add_config_data(data)
        return r

    @classmethod
    def from_config(cls, cfg: Any) -> "Redactor":
        """From a validated ``HiCacheConfig``."""
        return cls.from_config_data(cfg.model_dump())

    def text(self, s: str) -> str:
        """``s`` with URL passwords and every known secret replaced by ``***``."""
        if not isinstance(s, str):
            s = str(s)
        for secret in self._secrets:  # first: a pattern may cut a known secret (one with a space) in two
            if secret in s:
                s = s.replace(secret, REDACTED)
        s = _URLISH.sub(lambda m: redact_url(m.group(0)), s)
        return _SECRET_QUERY.sub(r"\1" + REDACTED, s)

    def value(self, v: Any) -> Any:
        """``v`` with every string inside (dicts, lists) redacted; for JSON output."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, Mapping):
            return {k: self.value(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [self.value(x) for x in v]
        return v

    def log_filter(self) -> logging.Filter:
        """A filter that redacts each record's final message (and traceback text)."""
        return _RedactFilter(self)


class _RedactFilter(logging.Filter):
    def __init__(self, redactor: Redactor):
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        red = self.redactor.text(msg)
        if red != msg:
            record.msg, record.args = red, None
        if record.exc_text:
            record.exc_text = self.redactor.text(record.exc_text)
        return True


def install_log_redaction(redactor: Redactor) -> None:
    """Redact every record that reaches the root logger's handlers (call after ``basicConfig``)."""
    root = logging.getLogger()
    for h in root.handlers:
        for f in list(h.filters):
            if isinstance(f, _RedactFilter):
                h.removeFilter(f)
        h.addFilter(redactor.log_filter())


class LogLimiter:
    def __init__(self, logger: logging.Logger, *, burst: int = 5, interval_s: float = 60.0,
                 max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        if burst < 1 or not interval_s > 0 or max_keys < 1:
            raise InvalidArgument(f"LogLimiter needs burst >= 1, interval_s > 0, max_keys >= 1; got burst={burst}, "
                                  f"interval_s={interval_s}, max_keys={max_keys}")
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self._lock = threading.Lock()
        # key -> [window start, records let through in it, suppressed since the last one let through]
        self._keys: OrderedDict[str, list[float]] = OrderedDict()
        self.suppressed_total = 0

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` is over its budget; True when logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        with self._lock:
            st = self._keys.get(key)
            if st is None:
                st = self._keys[key] = [now, 0, 0]
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            if now - st[0] >= self.interval_s:
                st[0], st[1] = now, 0
            if st[1] >= self.burst:
                st[2] += 1
                self.suppressed_total += 1
                return False
            st[1] += 1
            dropped, st[2] = int(st[2]), 0
        if dropped:
            msg = f"{msg} ({dropped} similar message(s) suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args)
