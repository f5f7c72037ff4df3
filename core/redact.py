"""One redaction for every secret the harness knows of, applied wherever results, reports and errors
are written or printed.

Known secrets: the values of environment variables whose names look secret (``*_KEY``, ``*_TOKEN``,
``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``; not ``*TOKENIZER*`` / ``*_TOKENS``), any value registered with
`register_secret` (an ``--api-key`` given on a command line, see `register_argv`), each also in its URL-encoded
and JSON-escaped forms. Whatever the value, these are redacted too: the ``user:password@`` part of URLs, the
credential of an ``Authorization:`` header (``Bearer``/``Basic``/``token``) and of a bare ``Bearer <token>``; in a
whole URL (``scheme://...``) every query and fragment value unless its key is allow-listed (`redact_url`:
``?client_secret=``, ``?sig=``, ``?access_key=`` alike), and in a scheme-less query the values of secret-looking keys.
An environment written into a record or a log is redacted by key as well as by value (`redact_env`:
``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``, ``*AUTH*``, ``*SIG*``, ...), so a token that is
in no other list (an ``--engine-env`` value, a profile's own ``[env]``) is hidden too.

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
# a scheme is short: bounded, so a long run of letters is scanned in linear time (unbounded: quadratic, 69 s for
# 200,000 letters)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,31}://)(?P<cred>[^/\s@:]*:[^/\s@]*|[^/\s@:]+)@")
# "Authorization: Bearer X", "authorization': 'Basic X", "Authorization=token X": the credential, whatever it is
_AUTH_HEADER = re.compile(r"(?P<head>\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)"
                          r"(?:(?P<scheme>bearer|basic|token|digest)\s+)?(?P<cred>[^\s\"',;}\]]+)", re.IGNORECASE)
_BEARER = re.compile(r"\b(?P<head>Bearer\s+)(?P<cred>[A-Za-z0-9._~+/-]{6,}=*)")   # the header's own casing
# a query of a URL without its scheme ("GET /v1/models?api_key=..."): values under secret-looking keys
_QUERY_SECRET = re.compile(r"(?P<head>[?&#][A-Za-z0-9_.-]*(?:key|token|secret|password|passwd|pwd|sig|signature|"
                           r"credential|auth|session|code)[A-Za-z0-9_.-]*=)(?!<redacted>)(?P<cred>[^&#\s\"']+)",
                           re.IGNORECASE)
# a whole URL in text: redact_url treats every query value, fragment value and userinfo as secret
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s\"'<>`]+")
# query keys whose values are never secret (kept in a redacted URL); every other value is hidden
URL_SAFE_QUERY_KEYS = frozenset({"model", "format", "stream", "api-version", "api_version", "version"})
# names whose value is hidden wherever an environment is written, whatever the value (broader than SECRET_NAME,
# which also decides what is redacted from all text by value, so it stays narrow); a bare PASS is a verdict word
SECRET_ENV_NAME = re.compile(r"KEY|TOKEN(?!IZER|S)|SECRET|PASSWORD|PASSWD|_PASS(?:_|$)|^PASS_|PWD|CREDENTIAL|"
                             r"AUTH(?!OR)|(?:^|_)SIG(?:NATURE)?(?:_|$)|SIGNATURE|COOKIE|SESSION|PRIVATE",
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
    text = _URL.sub(_url_in_text, text)
    text = _QUERY_SECRET.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def _url_in_text(m: re.Match) -> str:
    url = m.group(0)
    cut = len(url.rstrip(").,;:!]}"))   # a sentence's punctuation after the URL is not part of it
    return redact_url(url[:cut]) + url[cut:]


def _redact_pairs(text: str) -> str:
    """``k=v&k2=v2`` with every value hidden unless its key is in URL_SAFE_QUERY_KEYS; a bare item (no ``=``)
    is hidden whole."""
    out = []
    for item in text.split("&"):
        key, eq, value = item.partition("=")
        if not item:
            out.append(item)
        elif not eq:
            out.append(REDACTED)
        elif key.lower() in URL_SAFE_QUERY_KEYS or not value or value == REDACTED:
            out.append(item)
        else:
            out.append(f"{key}={REDACTED}")
    return "&".join(out)


def redact_url(url: str) -> str:
    """A URL with its userinfo and every query value hidden (unless its key is in URL_SAFE_QUERY_KEYS), and a
    fragment that carries values (``#access_token=...``) likewise; scheme, host, port and path kept."""
    from urllib.parse import urlsplit, urlunsplit

    if not isinstance(url, str) or not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:   # not a URL urllib can split: the text rules still apply
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = _redact_pairs(parts.query) if parts.query else parts.query
    fragment = _redact_pairs(parts.fragment) if "=" in parts.fragment else parts.fragment
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def value_is_set(v: Any) -> bool:
    return v is not None and v != ""


def secret_env_name(name: str) -> bool:
    """Whether an environment variable's name says its value is secret (SECRET_ENV_NAME)."""
    return bool(SECRET_ENV_NAME.search(name))


def redact_env(env: Mapping[str, str], secrets: Iterable[str] | None = None) -> dict[str, str]:
    """An environment as it may be written into a record or a log: by KEY, the value of every secret-looking
    name hidden whatever it is (an --engine-env or a profile's own token is in no other list); by VALUE, every
    known secret inside the other values (`redact`)."""
    secrets = known_secrets() if secrets is None else list(secrets)
    return {str(k): (REDACTED if secret_env_name(str(k)) and value_is_set(v) else redact(str(v), secrets))
            for k, v in env.items()}


_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def _secret_env_key(key: Any) -> bool:
    """An environment variable's name (upper case, as every record stores an environment) that says its value is
    secret; record fields are lower case and keep their values."""
    return isinstance(key, str) and bool(_ENV_NAME.fullmatch(key)) and secret_env_name(key)


def redact_data(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of a JSON-like structure with `redact` applied to every string, keys included; under a key that is
    a secret-looking environment variable name (``HF_TOKEN``, ``MY_SIG``: `secret_env_name`) the value is hidden
    whatever it is, so an environment stored in a record is redacted by key as well as by value. Only a string is
    hidden by key (an environment's values are strings): a number or a table under an upper-case key (a count, a
    typed field) keeps its shape, its strings redacted by value."""
    secrets = known_secrets() if secrets is None else list(secrets)
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        return {redact(k, secrets) if isinstance(k, str) else k:
                (REDACTED if _secret_env_key(k) and isinstance(v, str) and value_is_set(v)
                 else redact_data(v, secrets))
                for k, v in value.items()}
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
