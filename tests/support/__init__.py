"""What several test modules share beyond fake workers (those are in ``tests/fakes``): gateway
and cluster helpers, request and payload builders, oracles. A test module holds tests only and
imports no other test module (``tests/unit/test_layering.py`` checks it)."""
