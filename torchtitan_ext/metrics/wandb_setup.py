"""wandb set-up: the variables torchtitan's ``WandBLogger`` reads, offline logging without
credentials (environment or netrc), and where a run went (folder, URL, sync command)."""

import netrc
import os
import shlex
from dataclasses import dataclass
from urllib.parse import urlparse

from torchtitan.tools.logging import logger


def wandb_has_credentials() -> bool:
    """True if an API key is set in the environment or in netrc for the wandb host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    if host is None:
        return False
    netrc_path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(netrc_path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def configure_wandb_environment(*, project: str | None, entity: str | None, run_name: str | None) -> None:
    """Set the variables torchtitan's ``WandBLogger`` reads; go offline without credentials.

    Config values win over the environment; ``WANDB_MODE`` set by the user is kept.
    """
    for variable, value in (("WANDB_PROJECT", project), ("WANDB_TEAM", entity), ("WANDB_RUN_NAME", run_name)):
        if value is not None:
            os.environ[variable] = value
    if "WANDB_MODE" not in os.environ and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        logger.info("wandb: no credentials configured, logging offline")


@dataclass(kw_only=True, slots=True)
class WandbRunLocation:
    """Where a wandb run went: its local folder, and its URL when it is online."""

    folder: str
    url: str | None

    @property
    def sync_command(self) -> str | None:
        """The command that uploads an offline run (None for an online run)."""
        return None if self.url else f"wandb sync {shlex.quote(self.folder)}"

    def describe(self) -> str:
        if self.url:
            return f"{self.url} (local files: {self.folder})"
        return f"{self.folder} (offline; upload it with: {self.sync_command})"


def wandb_run_location(run) -> WandbRunLocation:
    """Folder and URL of a live ``wandb.Run`` (read before ``wandb.finish``)."""
    offline = bool(getattr(run, "offline", False))
    return WandbRunLocation(folder=os.path.abspath(run.settings.sync_dir), url=None if offline else run.url)
