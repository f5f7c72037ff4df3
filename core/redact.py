"""One redaction for every secret the harness knows of, applied wherever results, reports and errors
are written or printed.

Known secrets: the values of environment variables whose names look secret (``*_KEY``, ``*_TOKEN``,
``*SECRET*``, ``*PASSWORD*``; not ``*TOKENIZER*`` / ``*_TOKENS``), any value registered with
`register_secret` (an ``--api-key`` given on a command line), and the ``user:password@`` part of URLs.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"KEY|TOKEN(?!IZER|S)|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# Values this short would blank ordinary words and numbers; no real key is this short.
MIN_SECRET_LEN = 6
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<cred>[^/\s@:]*:[^/\s@]*|[^/\s@:]+)@")

_registered: set[str] = set()


def register_secret(value: str | None) -> None:
    """Redact `value` from everything written or printed from now on in this process."""
    if value and len(value) >= MIN_SECRET_LEN:
        _registered.add(value)


def register_url_credentials(url: str | None) -> None:
    """Register the password of a ``user:password@`` URL, and the Basic-auth token built from it (an engine
    may echo its Authorization header)."""
    import base64
    from urllib.parse import urlsplit

    if not url:
        return
    parts = urlsplit(url)
    if parts.password:
        register_secret(parts.password)
        cred = f"{parts.username or ''}:{parts.password}"
        register_secret(cred)
        register_secret(base64.b64encode(cred.encode()).decode())


def known_secrets(env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if SECRET_NAME.search(k) and v and len(v) >= MIN_SECRET_LEN}
    found |= _registered
    found |= {v for v in extra if v and len(v) >= MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)   # longest first: a key containing another is hidden whole


def redact(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret and every URL credential replaced by <redacted>."""
    if not isinstance(text, str) or not text:
        return text
    for s in (known_secrets() if secrets is None else secrets):
        if s in text:
            text = text.replace(s, REDACTED)
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact_data(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of a JSON-like structure with `redact` applied to every string, keys included."""
    secrets = known_secrets() if secrets is None else list(secrets)
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        return {redact(k, secrets) if isinstance(k, str) else k: redact_data(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_data(v, secrets) for v in value]
    return value
