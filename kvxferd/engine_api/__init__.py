"""The engine API: the gRPC servicer engines call, its Unix-socket fast lane, the host-pool
socket and registrations whose GPU ring is still being imported."""
