"""Panel files: parsing, validation, content hashing and the published-hash check.

A panel is a JSONL file (one item per line) plus a manifest `<name>-<version>.manifest.json` that
publishes name, version and the sha256 of the canonical JSON of the items. Loading recomputes the
hash and refuses a mismatch: an edited published panel would make every history comparison
meaningless, so a change must become a new version instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from panels.model import (
    DOMAINS,
    ROLES,
    SCORE_POLICIES,
    Message,
    Panel,
    PanelError,
    PanelHashMismatch,
    PanelInfo,
    PanelItem,
    ToolCall,
    ToolSpec,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_REF_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9_-]*)(?:@(?P<version>[0-9]+))?$")


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def content_hash(items: tuple[PanelItem, ...] | list[PanelItem]) -> str:
    """sha256 over the canonical JSON of the parsed items, so formatting of the file does not matter
    but every field that changes tokens or scored positions does."""
    return "sha256:" + hashlib.sha256(canonical_json([i.to_json() for i in items])).hexdigest()


# ----------------------------------------------------------------------------------------------
# item parsing


def _need(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise PanelError(f"{where}: missing field '{key}'")
    val = obj[key]
    if not isinstance(val, typ) or isinstance(val, bool) and typ is not bool:
        raise PanelError(f"{where}: field '{key}' must be {getattr(typ, '__name__', typ)}, got {type(val).__name__}")
    return val


def _check_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise PanelError(f"{where}: unknown field(s) {extra}; allowed: {sorted(allowed)}")


def _parse_tool_call(obj: Any, where: str) -> ToolCall:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a tool call must be an object")
    _check_keys(obj, {"id", "name", "arguments"}, where)
    args = _need(obj, "arguments", dict, where)
    return ToolCall(id=_need(obj, "id", str, where), name=_need(obj, "name", str, where), arguments=args)


def _parse_tool_spec(obj: Any, where: str) -> ToolSpec:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a tool spec must be an object")
    _check_keys(obj, {"name", "description", "parameters"}, where)
    return ToolSpec(
        name=_need(obj, "name", str, where),
        description=_need(obj, "description", str, where),
        parameters=_need(obj, "parameters", dict, where),
    )


def _parse_message(obj: Any, where: str) -> Message:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a message must be an object")
    _check_keys(obj, {"role", "content", "tool_calls", "tool_call_id", "reasoning"}, where)
    role = _need(obj, "role", str, where)
    if role not in ROLES:
        raise PanelError(f"{where}: unknown role '{role}'; expected one of {list(ROLES)}")
    content = _need(obj, "content", str, where)
    calls = tuple(
        _parse_tool_call(c, f"{where} tool_calls[{k}]") for k, c in enumerate(obj.get("tool_calls", []))
    )
    if calls and role != "assistant":
        raise PanelError(f"{where}: only assistant messages may carry tool_calls")
    call_id = obj.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise PanelError(f"{where}: a tool message needs a string 'tool_call_id'")
    if role != "tool" and call_id is not None:
        raise PanelError(f"{where}: 'tool_call_id' is only valid on tool messages")
    if not content.strip() and not calls:
        raise PanelError(f"{where}: empty {role} message")
    reasoning = obj.get("reasoning")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise PanelError(f"{where}: 'reasoning' must be a string on an assistant message")
    return Message(role=role, content=content, tool_calls=calls, tool_call_id=call_id, reasoning=reasoning)


def parse_item(obj: Any, where: str) -> PanelItem:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: an item must be a JSON object, got {type(obj).__name__}")
    item_id = _need(obj, "id", str, where)
    if not _ID_RE.match(item_id):
        raise PanelError(f"{where}: bad id '{item_id}' (lowercase letters, digits, '.', '_', '-'; max 64)")
    where = f"{where} (item '{item_id}')"
    domain = _need(obj, "domain", str, where)
    if domain not in DOMAINS:
        raise PanelError(f"{where}: unknown domain '{domain}'; expected one of {list(DOMAINS)}")
    kind = _need(obj, "kind", str, where)
    score = _need(obj, "score", str, where)
    if score not in SCORE_POLICIES:
        raise PanelError(f"{where}: unknown score policy '{score}'; expected one of {list(SCORE_POLICIES)}")
    lang = obj.get("lang")
    if lang is not None and not isinstance(lang, str):
        raise PanelError(f"{where}: 'lang' must be a string")
    if kind == "raw":
        _check_keys(obj, {"id", "domain", "kind", "score", "text", "lang", "tokens", "positions"}, where)
        text = _need(obj, "text", str, where)
        if not text.strip():
            raise PanelError(f"{where}: empty text")
        if score == "positions":
            tokens, positions = _parse_positions(obj, where)
            return PanelItem(id=item_id, domain=domain, kind="raw", score="positions", text=text, lang=lang,
                             tokens=tokens, positions=positions)
        if score != "all" or "tokens" in obj or "positions" in obj:
            raise PanelError(f"{where}: raw items are scored with 'all' (or 'positions' with 'tokens' and "
                             f"'positions'), got '{score}'")
        return PanelItem(id=item_id, domain=domain, kind="raw", score="all", text=text, lang=lang)
    if kind == "chat":
        _check_keys(obj, {"id", "domain", "kind", "score", "messages", "tools", "lang"}, where)
        raw_msgs = _need(obj, "messages", list, where)
        msgs = tuple(_parse_message(m, f"{where} messages[{k}]") for k, m in enumerate(raw_msgs))
        if not msgs:
            raise PanelError(f"{where}: no messages")
        if msgs[-1].role != "assistant":
            raise PanelError(f"{where}: the last message must be the assistant reply to score, got '{msgs[-1].role}'")
        if not msgs[-1].content.strip():
            raise PanelError(f"{where}: empty assistant reply")
        if score not in ("assistant", "last"):
            raise PanelError(f"{where}: chat items are scored with 'assistant' or 'last', got '{score}'")
        for k, m in enumerate(msgs):
            if m.role == "system" and k != 0:
                raise PanelError(f"{where} messages[{k}]: a system message may only come first")
        tools = tuple(_parse_tool_spec(t, f"{where} tools[{k}]") for k, t in enumerate(obj.get("tools", [])))
        _check_tool_ids(msgs, tools, where)
        return PanelItem(id=item_id, domain=domain, kind="chat", score=score, messages=msgs, tools=tools, lang=lang)
    raise PanelError(f"{where}: unknown kind '{kind}'; expected 'raw' or 'chat'")


def _parse_positions(obj: dict[str, Any], where: str) -> tuple[int, tuple[int, ...]]:
    """A long item's exact token count and its scored positions: increasing, each in [1, tokens)."""
    tokens = _need(obj, "tokens", int, where)
    raw = _need(obj, "positions", list, where)
    if tokens < 2:
        raise PanelError(f"{where}: 'tokens' must be at least 2, got {tokens}")
    if not raw or not all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
        raise PanelError(f"{where}: 'positions' must be a non-empty list of integers")
    for k, p in enumerate(raw):
        if not 1 <= p < tokens:
            raise PanelError(f"{where}: positions[{k}] = {p} is outside [1, {tokens - 1}]")
        if k and p <= raw[k - 1]:
            raise PanelError(f"{where}: positions[{k}] = {p} does not increase (after {raw[k - 1]})")
    return tokens, tuple(raw)


def _check_tool_ids(msgs: tuple[Message, ...], tools: tuple[ToolSpec, ...], where: str) -> None:
    names = {t.name for t in tools}
    open_ids: set[str] = set()
    for k, m in enumerate(msgs):
        for c in m.tool_calls:
            if c.name not in names:
                raise PanelError(f"{where} messages[{k}]: call to undeclared tool '{c.name}'")
            open_ids.add(c.id)
        if m.role == "tool" and m.tool_call_id not in open_ids:
            raise PanelError(f"{where} messages[{k}]: tool result for unknown call id '{m.tool_call_id}'")


def parse_jsonl(path: Path) -> tuple[PanelItem, ...]:
    items: list[PanelItem] = []
    seen: dict[str, int] = {}
    try:
        # JSONL lines end at "\n" only: str.splitlines() also splits at U+2028, U+2029 and U+0085, which JSON
        # allows raw inside strings, so it would refuse valid panels
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise PanelError(f"{path}: not UTF-8 ({e})") from e
    except OSError as e:
        raise PanelError(f"{path}: cannot read the panel ({e.strerror or e})") from e
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PanelError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise PanelError(f"{where}: text holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), "
                             "which is not a character") from None
        item = parse_item(obj, where)
        if item.id in seen:
            raise PanelError(f"{where}: duplicate id '{item.id}' (first on line {seen[item.id]})")
        seen[item.id] = lineno
        items.append(item)
    if not items:
        raise PanelError(f"{path}: no items")
    return tuple(items)


# ----------------------------------------------------------------------------------------------
# manifests


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PanelError(f"{path}: manifest is not UTF-8 (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise PanelError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise PanelError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e
    if not isinstance(obj, dict):
        raise PanelError(f"{path}: a manifest must be a JSON object")
    where = str(path)
    # `sources`: where a panel's text comes from, its version and licence (long@1; display only, not hashed)
    _check_keys(obj, {"name", "version", "file", "content_hash", "description", "domains", "sources"}, where)
    _need(obj, "name", str, where)
    version = _need(obj, "version", int, where)
    if version < 1:
        raise PanelError(f"{where}: version must be >= 1")
    _need(obj, "file", str, where)
    h = _need(obj, "content_hash", str, where)
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", h):
        raise PanelError(f"{where}: content_hash must be 'sha256:<64 hex>'")
    return obj


def list_panels(data_dir: Path = DATA_DIR) -> list[PanelInfo]:
    out = []
    for mpath in sorted(data_dir.glob("*.manifest.json")):
        m = _read_manifest(mpath)
        out.append(
            PanelInfo(
                name=m["name"],
                version=m["version"],
                content_hash=m["content_hash"],
                path=str(mpath),
                description=m.get("description", ""),
            )
        )
    out.sort(key=lambda p: (p.name, p.version))
    return out


def load_manifest_panel(manifest_path: Path) -> Panel:
    m = _read_manifest(manifest_path)
    items_path = manifest_path.parent / m["file"]
    if not items_path.is_file():
        raise PanelError(f"{manifest_path}: items file '{m['file']}' not found")
    items = parse_jsonl(items_path)
    got = content_hash(items)
    if got != m["content_hash"]:
        raise PanelHashMismatch(
            f"{items_path}: content hash {got} does not match the published hash {m['content_hash']} in "
            f"{manifest_path.name}. A published panel never changes; publish the edit as a new version."
        )
    declared = m.get("domains")
    if declared is not None:
        present = sorted({i.domain for i in items})
        if sorted(declared) != present:
            raise PanelError(f"{manifest_path}: declares domains {sorted(declared)} but items have {present}")
    return Panel(
        name=m["name"], version=m["version"], content_hash=got, items=items, description=m.get("description", "")
    )


def load_panel(ref: str | Path = "default", data_dir: Path = DATA_DIR) -> Panel:
    """`name` (newest version), `name@version`, or a path to a manifest file."""
    p = Path(ref)
    if str(ref).endswith(".manifest.json"):
        if not p.is_file():
            raise PanelError(f"{p}: manifest not found")
        return load_manifest_panel(p)
    match = _REF_RE.match(str(ref))
    if not match:
        raise PanelError(f"bad panel reference '{ref}'; use NAME, NAME@VERSION or a *.manifest.json path")
    name, version = match["name"], match["version"]
    known = [i for i in list_panels(data_dir) if i.name == name]
    if not known:
        names = sorted({i.name for i in list_panels(data_dir)})
        raise PanelError(f"unknown panel '{name}'; known: {names}")
    if version is None:
        info = known[-1]
    else:
        hits = [i for i in known if i.version == int(version)]
        if not hits:
            raise PanelError(f"panel '{name}' has no version {version}; published: {[i.version for i in known]}")
        info = hits[0]
    panel = load_manifest_panel(Path(info.path))
    if panel.name != name:
        raise PanelError(f"{info.path}: manifest name '{panel.name}' does not match '{name}'")
    return panel
