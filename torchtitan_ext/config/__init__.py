"""A run's ``Trainer.Config`` from its flavor, TOML files and command line.

- ``toml_files``: a TOML file as ``{dotted_key: value}``, with the line of each key.
- ``config_tree``: the dotted keys of a ``Trainer.Config`` (fields, list items, the model).
- ``short_keys``: natural names for common knobs (``training.lr``, ``moe.compute_backend``).
- ``value_types``: a value checked against a field's type annotation.
- ``value_sources``: where each overridden value came from ("file:line", "command line").
- ``apply``: overrides and TOML files applied to a copy of a config, all or nothing.
- ``checks``: the start-up checks run on the final config.
- ``command_line``: ``--name value`` options taken out of the command line.

Every problem is a ``ConfigError`` whose message is for the user.
"""


class ConfigError(ValueError):
    """A bad flavor name, TOML file, key or value; the message is for the user."""
