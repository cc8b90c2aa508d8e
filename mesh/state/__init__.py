"""State shared by several gateway replicas through Redis: session bindings and in-flight load."""
