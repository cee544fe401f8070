"""The data mover: the Transport interface and its NIXL implementation."""
