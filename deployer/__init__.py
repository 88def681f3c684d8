"""Kubernetes deployer of the Coordinator: `python -m deployer render`.

deployer.sections (the deployment keys) <- deployer.kubernetes (what the API server accepts) <- deployer.checks
(each section's checks); deployer.sections <- deployer.render (the bundle); deployer.settings (`load`: the checks,
then the Coordinator's own loader on the rendered user_config.json) uses them all.
"""

from .sections import ConfigError, Settings  # noqa: F401
from .settings import load  # noqa: F401
