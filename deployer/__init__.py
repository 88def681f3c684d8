"""Kubernetes deployer of the Coordinator: `python -m deployer render`."""

from .settings import ConfigError, Settings, load  # noqa: F401
