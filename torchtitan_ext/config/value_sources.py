"""Where each overridden value came from ("file:line" or "command line"), and the flavor and TOML
files a run's config was resolved from, so errors can say."""

from dataclasses import dataclass, field


@dataclass
class _ResolvedFrom:
    flavor: str | None = None
    toml_files: list[str] = field(default_factory=list)


_VALUE_SOURCES: dict[str, str] = {}
_RESOLVED_FROM = _ResolvedFrom()


def forget_value_sources() -> None:
    """Start recording value sources afresh: call before resolving a new run's config."""
    _VALUE_SOURCES.clear()
    _RESOLVED_FROM.flavor, _RESOLVED_FROM.toml_files = None, []


def record_resolved_from(flavor: str, toml_files: list[str]) -> None:
    """Remember the flavor and TOML files the config being resolved comes from."""
    _RESOLVED_FROM.flavor, _RESOLVED_FROM.toml_files = flavor, list(toml_files)


def resolved_from() -> tuple[str | None, list[str]]:
    """(flavor, TOML files) of the config being resolved; (None, []) for one built otherwise."""
    return _RESOLVED_FROM.flavor, list(_RESOLVED_FROM.toml_files)


def record_value_sources(sources: dict[str, str]) -> None:
    """Remember ``{dotted_key: where its value came from}`` of overrides just applied."""
    _VALUE_SOURCES.update(sources)


def value_source(*keys: str) -> str | None:
    """Where the value of the first of ``keys`` that was overridden came from ("file:line", "command line")."""
    for key in keys:
        if key in _VALUE_SOURCES:
            return _VALUE_SOURCES[key]
    return None
