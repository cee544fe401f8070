"""Fault tests (issue #7 and the failure tests of issue #3): real subprocess daemons, real NIXL,
engine processes that use only kvxfer_client, every byte of every successful room checked."""
