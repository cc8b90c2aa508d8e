"""Worker KV events into the prefix index: the wire format, the subscriber's stream protocol
(sequence, gap, replay, restart), ingestion."""
