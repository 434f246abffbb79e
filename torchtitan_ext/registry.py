"""The flavor registry: named, complete torchtitan training configs.

An experiment is a sub-package of ``torchtitan_ext.experiments`` (the repository's
``experiments/`` folder) with a ``flavors`` module that registers its flavors with
``@register_flavor``. ``load_experiments`` imports every experiment's ``flavors``, so
adding an experiment folder is all it takes for its flavors to appear. The package's
own ``__init__`` stays light, so its layers import without torchtitan's Trainer.

The framework reaches an experiment only through this registry: besides its flavors, an
experiment may register ``@register_run_description`` functions saying what identifies a
run of a config (e.g. its compute backend), which the metrics record as run metadata, and
``@register_startup_note`` functions whose notes about a valid config (e.g. a faster setting
for this machine) the train entry logs before training.
"""

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.protocols.model import BaseModel
from torchtitan.trainer import Trainer

import torchtitan_ext.experiments as experiments_package
from torchtitan_ext.config.names import unknown_flavor_message


class UnknownFlavorError(KeyError):
    """Raised for a flavor name that is not registered; the message suggests close names."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Flavor:
    """A registered flavor: ``build()`` returns a fresh ``Trainer.Config`` each call."""

    name: str
    description: str
    experiment: str
    build: Callable[[], Trainer.Config]

    @property
    def torchtitan_args(self) -> list[str]:
        """The same config through torchtitan's own config registry: ``--module M --config F``.

        ``build`` is a function of its experiment's flavors module under its own name.
        """
        return ["--module", self.build.__module__, "--config", self.build.__name__]

    def build_config(self) -> Trainer.Config:
        """A fresh ``build()`` with every experiment's config adapter applied (``register_config_adapter``):
        the config TOML files and the command line start from."""
        config = self.build()
        for adapt in _CONFIG_ADAPTERS:
            adapt(config)
        return config

    def build_model_config(self) -> BaseModel.Config:
        """The model config of a fresh ``build_config()`` (every flavor names its model)."""
        model_spec = self.build_config().model_spec
        assert model_spec is not None, f"flavor {self.name} builds a config without a model"
        return model_spec.model


_FLAVORS: dict[str, Flavor] = {}

_CONFIG_ADAPTERS: list[Callable[[Trainer.Config], None]] = []


def register_config_adapter(adapt: Callable[[Trainer.Config], None]):
    """Decorator registering ``adapt(config)``, run in place on every flavor's built config before the
    TOML files and the command line (e.g. taking what a torchtitan converter made as the experiment's
    own setting, so that the experiment's keys apply to it)."""
    _CONFIG_ADAPTERS.append(adapt)
    return adapt


def register_flavor(name: str, description: str):
    """Decorator registering a zero-argument function returning a ``Trainer.Config``.

    The function must be reachable as ``getattr(flavors_module, build.__name__)`` so that the
    flavors module serves as torchtitan's config registry (``--module``/``--config``): a
    lambda is refused.
    """

    def decorator(build: Callable[[], Trainer.Config]) -> Callable[[], Trainer.Config]:
        if build.__name__ == "<lambda>":
            raise ValueError(f"flavor {name!r}: register a named function, not a lambda")
        if name in _FLAVORS:
            raise ValueError(
                f"flavor {name!r} is registered twice ({_FLAVORS[name].experiment} and {build.__module__})"
            )
        experiment = build.__module__.removeprefix(experiments_package.__name__ + ".")
        _FLAVORS[name] = Flavor(name, description, experiment.split(".")[0], build)
        return build

    return decorator


def load_experiments() -> None:
    """Import every experiment's ``flavors`` module so that its flavors are registered."""
    for module in pkgutil.iter_modules(experiments_package.__path__):
        if module.ispkg:
            importlib.import_module(f"{experiments_package.__name__}.{module.name}.flavors")


def all_flavors() -> list[Flavor]:
    load_experiments()
    return sorted(_FLAVORS.values(), key=lambda f: (f.experiment, f.name))


def get_flavor(name: str) -> Flavor:
    load_experiments()
    if name in _FLAVORS:
        return _FLAVORS[name]
    raise UnknownFlavorError(unknown_flavor_message(name, _FLAVORS))


_RUN_DESCRIPTIONS: list[Callable[[Trainer.Config], dict[str, Any]]] = []


def register_run_description(describe: Callable[[Trainer.Config], dict[str, Any]]):
    """Decorator registering ``describe(config) -> {name: value}``: what identifies a run of ``config``."""
    _RUN_DESCRIPTIONS.append(describe)
    return describe


def describe_run(config: Trainer.Config) -> dict[str, Any]:
    """What every experiment's ``register_run_description`` functions say about a run of ``config``."""
    load_experiments()
    return {name: value for describe in _RUN_DESCRIPTIONS for name, value in describe(config).items()}


_STARTUP_NOTES: list[Callable[[Trainer.Config], str | None]] = []


def register_startup_note(note: Callable[[Trainer.Config], str | None]):
    """Decorator registering ``note(config) -> str | None``: a line to log before training (None: nothing)."""
    _STARTUP_NOTES.append(note)
    return note


def startup_notes(config: Trainer.Config) -> list[str]:
    """Every registered note about ``config`` that has something to say."""
    load_experiments()
    return [line for note in _STARTUP_NOTES if (line := note(config)) is not None]
