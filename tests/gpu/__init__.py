"""GPU end-to-end tests (CUDA IPC rings, VRAM over NIXL); skipped without CUDA."""
