"""The options of a module's ``Config``, checked by one method at construction and at start-up."""

from collections.abc import Callable


class ValidatedConfig:
    """Mixin of a nested ``Config`` dataclass whose options have rules (ranges, choices).

    ``validation_errors(key)`` returns every broken rule, one message each, naming a field as
    ``key(field)``: constructing the config raises ``ValueError`` with all of them, and the
    experiment's start-up check calls it on the final config with ``key`` naming the TOML key
    and where its value came from.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        if errors := self.validation_errors():
            raise ValueError("; ".join(errors))

    def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
        """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
        raise NotImplementedError


def choice_errors(key: Callable[[str], str], field: str, value: object, choices: tuple[str, ...]) -> list[str]:
    """The message of ``field = value`` when ``value`` is not one of ``choices`` (empty list: it is)."""
    if value in choices:
        return []
    return [f"{key(field)} = {value!r}: not one of the valid choices: {', '.join(choices)}"]


def positive_or_off_errors(key: Callable[[str], str], field: str, value: float | None) -> list[str]:
    """The message of ``field = value`` when a setting that is positive or off (None) is neither."""
    if value is None or value > 0:
        return []
    return [f"{key(field)} = {value}: must be > 0, or off (None; 0 in TOML)"]
