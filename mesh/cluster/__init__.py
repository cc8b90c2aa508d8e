"""Which workers exist and whether they are well: the registry, health and circuit breakers,
``/metrics`` scrapes."""
