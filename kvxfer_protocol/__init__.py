"""The wire contract between kvxferd and its engines' client (and between daemons): generated
protobuf stubs, the lane frame format, shared limits, the slot layout, CUDA IPC handles and
the protocol version. It imports neither the daemon nor the client; both import it."""
