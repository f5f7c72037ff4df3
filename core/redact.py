"""One redaction for every secret the harness knows of, applied wherever results, reports and errors
are written or printed.

Known secrets: the values of environment variables whose names look secret (``*_KEY``, ``*_TOKEN``,
``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``; not ``*TOKENIZER*`` / ``*_TOKENS``), any value registered with
`register_secret` (an ``--api-key`` given on a command line, see `register_argv`), each also in its URL-encoded
and JSON-escaped forms. Whatever the value, these are redacted too: the ``user:password@`` part of URLs, the
credential of an ``Authorization:`` header (``Bearer``/``Basic``/``token``) and of a bare ``Bearer <token>``, and
``api_key=`` / ``access_token=`` / ``token=`` URL query values.

Every path out uses this module: error lines (`ds41gates.cli`), results.json and reports (the pytest plugin,
reports.render), records' provenance (core.records), the launcher's log header, and the nightly's printed
commands, cell logs, junit XML, summaries and history database (nightly.runner, nightly.history; `scrub_file`).
"""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any, Iterable, Mapping

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"KEY|TOKEN(?!IZER|S)|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Values this short would blank ordinary words and numbers; no real key is this short.
MIN_SECRET_LEN = 6
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<cred>[^/\s@:]*:[^/\s@]*|[^/\s@:]+)@")
# "Authorization: Bearer X", "authorization': 'Basic X", "Authorization=token X": the credential, whatever it is
_AUTH_HEADER = re.compile(r"(?P<head>\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)"
                          r"(?:(?P<scheme>bearer|basic|token|digest)\s+)?(?P<cred>[^\s\"',;}\]]+)", re.IGNORECASE)
_BEARER = re.compile(r"\b(?P<head>Bearer\s+)(?P<cred>[A-Za-z0-9._~+/-]{6,}=*)")   # the header's own casing
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:api[_-]?key|access[_-]?token|token|key|password|secret)=)(?P<cred>[^&#\s\"']+)",
                           re.IGNORECASE)

_registered: set[str] = set()


def register_secret(value: str | None) -> None:
    """Redact `value` from everything written or printed from now on in this process."""
    if value and len(value) >= MIN_SECRET_LEN:
        _registered.add(value)


def register_url_credentials(url: str | None) -> None:
    """Register the password of a ``user:password@`` URL, and the Basic-auth token built from it (an engine
    may echo its Authorization header)."""
    from urllib.parse import unquote, urlsplit

    if not url:
        return
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return
    if password:
        for u, pw in {(user or "", password), (unquote(user or ""), unquote(password))}:
            register_secret(pw)
            cred = f"{u}:{pw}"
            register_secret(cred)
            register_secret(base64.b64encode(cred.encode()).decode())


def register_text_credentials(text: str | None) -> None:
    """`register_url_credentials` for every ``scheme://user:password@`` URL inside `text` (an argv element such
    as ``--engine-url=http://u:p@host``, a config value)."""
    for m in _URL_CREDENTIALS.finditer(text or ""):
        register_url_credentials(f"{m.group('scheme')}{m.group('cred')}@x")


def register_argv(argv: Iterable[str]) -> None:
    """Register what a command line carries that is secret: URL credentials in any argument, and the value of
    an option whose name looks secret (``--api-key X``, ``--hf_token=X``; not ``--tokenizer``)."""
    args = [str(a) for a in argv]
    for i, a in enumerate(args):
        register_text_credentials(a)
        if not a.startswith("-"):
            continue
        name, eq, value = a.partition("=")
        if not SECRET_NAME.search(name.lstrip("-")):
            continue
        if eq:
            register_secret(value)
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            register_secret(args[i + 1])


def redact_command(argv: Iterable[str], secrets: Iterable[str] | None = None) -> str:
    """A command line as one printable string, its secrets registered first and then redacted."""
    args = [str(a) for a in argv]
    register_argv(args)
    return redact(" ".join(args), secrets)


def _forms(value: str) -> set[str]:
    """A secret as it may be written: raw, URL-encoded (a query, a URL's userinfo), JSON-escaped."""
    from urllib.parse import quote, quote_plus

    return {value, quote(value, safe=""), quote_plus(value, safe=""), json.dumps(value)[1:-1]}


def known_secrets(env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if SECRET_NAME.search(k) and v and len(v) >= MIN_SECRET_LEN}
    found |= _registered
    found |= {v for v in extra if v and len(v) >= MIN_SECRET_LEN}
    found = {f for v in found for f in _forms(v) if len(f) >= MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)   # longest first: a key containing another is hidden whole


def _auth_header(m: re.Match) -> str:
    scheme = f"{m.group('scheme')} " if m.group("scheme") else ""
    return f"{m.group('head')}{scheme}{REDACTED}"


def redact(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret, every URL credential and every Authorization credential replaced by
    <redacted>."""
    if not isinstance(text, str) or not text:
        return text
    for s in (known_secrets() if secrets is None else secrets):
        if s in text:
            text = text.replace(s, REDACTED)
    text = _AUTH_HEADER.sub(_auth_header, text)
    text = _BEARER.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
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


TEXT_SUFFIXES = (".json", ".jsonl", ".md", ".txt", ".log", ".csv", ".toml", ".yaml", ".yml", ".html", ".htm",
                 ".xml", ".svg")


def scrub_file(path: str | os.PathLike, secrets: Iterable[str] | None = None) -> bool:
    """Redact a text file the harness wrote, in place (atomically); True when anything was replaced.

    XML (pytest's junit) is redacted element by element and written back well-formed; HTML gets an escaped
    marker; anything else is redacted as text. A file that is not UTF-8 text, or has another suffix, is left
    as it is (binary records carry their own redacted provenance)."""
    from pathlib import Path

    from core.atomic import atomic_write_text

    p = Path(path)
    if p.suffix.lower() not in TEXT_SUFFIXES or not p.is_file():
        return False
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    secrets = known_secrets() if secrets is None else list(secrets)
    if p.suffix.lower() == ".xml":
        new = _redact_xml(text, secrets)
    else:
        new = redact(text, secrets)
        if p.suffix.lower() in (".html", ".htm", ".svg"):
            new = new.replace(REDACTED, "&lt;redacted&gt;")
    if new == text:
        return False
    atomic_write_text(p, new)
    return True


def _redact_xml(text: str, secrets: list[str]) -> str:
    import xml.etree.ElementTree as ET

    if redact(text, secrets) == text:
        return text
    try:
        root = ET.fromstring(text)
    except ET.ParseError:   # not well-formed: keep it text, with a marker that cannot break it further
        return redact(text, secrets).replace(REDACTED, "[redacted]")
    for el in root.iter():
        el.text, el.tail = redact(el.text, secrets), redact(el.tail, secrets)
        for k, v in list(el.attrib.items()):
            el.attrib[k] = redact(v, secrets)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
