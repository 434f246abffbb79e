"""Start-up checks: rules between settings that are valid one by one, run on the final config.

``register_config_check`` adds ``check(config)``; ``run_config_checks`` runs every check once,
after the TOML files and the command line, before any process group or model is built.
``register_value_check`` adds one that only reads the config, which also runs where some overrides
were refused (``value_check_errors``), so that one message lists every problem.
"""

from collections.abc import Callable
from typing import Any

from torchtitan_ext.config import ConfigError

_CONFIG_CHECKS: list[Callable[[Any], None]] = []
_VALUE_CHECKS: list[Callable[[Any], None]] = []


def register_config_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Decorator registering ``check(config)``, run on the final config before training starts.

    A check raises ``ConfigError`` for settings that are valid one by one but not together
    (e.g. expert count vs expert-parallel degree).
    """
    _CONFIG_CHECKS.append(check)
    return check


def register_value_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """``register_config_check`` for a check that only reads the config (resolves, logs and writes nothing):
    it also runs, through ``value_check_errors``, on a config some of whose overrides were refused one by
    one, so that the run's message lists its problems with theirs."""
    _VALUE_CHECKS.append(check)
    return register_config_check(check)


def _check_errors(checks: list[Callable[[Any], None]], config, *, problems_before: bool) -> list[str]:
    """What ``checks`` find in ``config``, one message each. A check that fails with another exception is
    taken as a consequence of problems already found (``problems_before``: some were, before these
    checks ran); where none were, the exception propagates."""
    errors: list[str] = []
    for check in checks:
        try:
            check(config)
        except ConfigError as e:
            errors.append(str(e))
        except Exception:
            if not (errors or problems_before):
                raise
    return errors


def value_check_errors(config) -> list[str]:
    """The problems the value checks (``register_value_check``) find in ``config``, whose overrides were
    refused in part, one message each."""
    return _check_errors(_VALUE_CHECKS, config, problems_before=True)


def run_config_checks(config) -> None:
    """Run every registered check on the final ``Trainer.Config``; one ``ConfigError`` lists all problems.

    A check that fails with another exception after earlier checks reported problems is
    taken as a consequence of those problems; on a clean config it propagates.
    """
    if errors := _check_errors(_CONFIG_CHECKS, config, problems_before=False):
        raise ConfigError("\n".join(dict.fromkeys(errors)))
