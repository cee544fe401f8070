"""One chunk's way: sender (prefill) and receiver (decode) sides, the scheduler that turns a
chunk into WRITEs, slot credits, the page fence, notifications and the transfer workers."""
