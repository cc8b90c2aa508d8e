"""An HTTP body becomes a ``RequestInfo``: parse and validate, render the chat template as the
engine does, tokenize, key the blocks."""
