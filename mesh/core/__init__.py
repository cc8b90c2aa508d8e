"""The decision core, free of I/O: router (decide, commit, leases), block keys, the prefix index,
the session table. The only part of ``mesh`` that ``policies/`` and ``simulator/`` import."""
