"""Kubernetes deployer of the Coordinator: `python -m deployer render`.

deployer.sections (the deployment keys and their checks) <- deployer.render (the bundle) <- deployer.settings
(`load`: the checks, then the Coordinator's own loader on the rendered user_config.json).
"""

from .sections import ConfigError, Settings  # noqa: F401
from .settings import load  # noqa: F401
