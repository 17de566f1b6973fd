"""Where the loop runs: the driver (Ray Train or torchrun), what a worker sees, oneCCL,
and the node facts the cluster doctor reads."""
