"""A plugin module that fails at import time (a dependency the operator forgot to install)."""

import mesh_missing_dependency_for_tests  # noqa: F401
