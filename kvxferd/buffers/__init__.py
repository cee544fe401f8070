"""Memory the daemon moves bytes from and to: the host pool and ring allocators, huge pages,
the memory limit check, engines' GPU staging rings."""
