"""Where each overridden value came from ("file:line" or "command line"), so errors can say."""

_VALUE_SOURCES: dict[str, str] = {}


def forget_value_sources() -> None:
    """Start recording value sources afresh: call before resolving a new run's config."""
    _VALUE_SOURCES.clear()


def record_value_sources(sources: dict[str, str]) -> None:
    """Remember ``{dotted_key: where its value came from}`` of overrides just applied."""
    _VALUE_SOURCES.update(sources)


def value_source(*keys: str) -> str | None:
    """Where the value of the first of ``keys`` that was overridden came from ("file:line", "command line")."""
    for key in keys:
        if key in _VALUE_SOURCES:
            return _VALUE_SOURCES[key]
    return None
