"""Imports every built-in plugin module so that each registers itself."""

import policies.basic  # noqa: F401
