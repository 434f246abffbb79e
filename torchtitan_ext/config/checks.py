"""Start-up checks: rules between settings that are valid one by one, run on the final config.

``register_config_check`` adds ``check(config)``; ``run_config_checks`` runs every check once,
after the TOML files and the command line, before any process group or model is built.
"""

from collections.abc import Callable
from typing import Any

from torchtitan_ext.config import ConfigError

_CONFIG_CHECKS: list[Callable[[Any], None]] = []


def register_config_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Decorator registering ``check(config)``, run on the final config before training starts.

    A check raises ``ConfigError`` for settings that are valid one by one but not together
    (e.g. expert count vs expert-parallel degree).
    """
    _CONFIG_CHECKS.append(check)
    return check


def run_config_checks(config) -> None:
    """Run every registered check on the final ``Trainer.Config``; one ``ConfigError`` lists all problems.

    A check that fails with another exception after earlier checks reported problems is
    taken as a consequence of those problems; on a clean config it propagates.
    """
    errors: list[str] = []
    for check in _CONFIG_CHECKS:
        try:
            check(config)
        except ConfigError as e:
            errors.append(str(e))
        except Exception:
            if not errors:
                raise
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
