"""The HTTP surface and the data plane: the app and its builder, the proxy's retry loop, the
client side, the upstream pool, the disaggregated relay."""
