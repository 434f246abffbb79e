"""A TOML file as ``{dotted_key: value}``: every leaf of its tree of tables is one dotted key."""

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan_ext.config import ConfigError


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse one TOML file into ``{dotted_key: value}``; errors name file and line."""
    return read_toml(Path(path))[0]


def read_toml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """``{dotted_key: value}`` of one TOML file and ``{dotted_key: line}`` where a line is found."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read TOML file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not a UTF-8 text file (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "TOML files must be UTF-8"
        ) from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    return dict(_flatten(tree)), _key_lines(text)


def toml_value(text: str) -> Any:
    """``text`` read as a TOML value (``2``, ``1e-3``, ``true``, ``"x"``), else the bare string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


_TABLE_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(r"^\s*([A-Za-z0-9_.\-\s\"']+?)\s*=")


def _key_lines(text: str) -> dict[str, int]:
    """Line number of each ``key = value`` of a TOML text, by dotted key (bare and quoted keys)."""
    lines, table = {}, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _TABLE_HEADER.match(line):
            table = _unquote_dotted(header.group(1)) + "."
        elif key := _KEY_LINE.match(line):
            lines.setdefault(table + _unquote_dotted(key.group(1)), number)
    return lines


def _unquote_dotted(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def _flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value
