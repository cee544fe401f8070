"""The fleet registry: what a daemon publishes about itself, and its etcd backend."""
