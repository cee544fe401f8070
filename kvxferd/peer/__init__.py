"""Other daemons: handshakes, the control stream (gRPC or plain frames), peer authentication,
caps, dispatch of what peers send, and healing through faults that pass."""
