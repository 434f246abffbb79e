"""How messages name what was not found: the close matches of a name among the known ones."""

import difflib
from collections.abc import Iterable


def close_matches_hint(name: str, known: Iterable[str], *, cutoff: float = 0.6, prefix: str = "") -> str:
    """``; did you mean a, b?`` for up to three close matches of ``name`` (each written ``prefix`` + match),
    else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=cutoff)
    return f"; did you mean {', '.join(prefix + match for match in close)}?" if close else ""


def unknown_flavor_message(name: str, known: Iterable[str]) -> str:
    return (
        f"unknown flavor {name!r}{close_matches_hint(name, known, cutoff=0.5)} "
        "(run `python -m torchtitan_ext.flavors` to list all flavors)"
    )


def unknown_key_message(key: str, known: Iterable[str]) -> str:
    return f"unknown key {key!r}{close_matches_hint(key, known)}"
