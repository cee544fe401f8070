"""The daemon's domain: the node facade, engines and their rings, rooms and their clock, the
types and caps they share, and what the room logic needs from a peer."""
