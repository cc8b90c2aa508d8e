"""The HTTP surface and the data plane: the app and its builder, its routes, the proxy's retry
loop, one SSE relay, the client side, the upstream pool, the disaggregated relay."""
