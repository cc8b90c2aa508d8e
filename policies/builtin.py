"""Imports every built-in plugin module so that each registers itself."""

import policies.cache_aware  # noqa: F401
import policies.filters  # noqa: F401
import policies.kv_aware  # noqa: F401
import policies.least_load  # noqa: F401
import policies.pickers  # noqa: F401
import policies.pipeline  # noqa: F401
import policies.power_of_two  # noqa: F401
import policies.round_robin  # noqa: F401
import policies.scorers  # noqa: F401
import policies.session_sticky  # noqa: F401
import policies.uniform_random  # noqa: F401
