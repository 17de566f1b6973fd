"""What the loop and its components see of the ranks they run among, below every package
that uses it: the `Runtime` seam (rank, world size, report, the run's storage) and the host
agreement between ranks (`hostsync`). The runtimes themselves (Ray Train, torchrun) live
in `trainer.runtime`, above the loop that they start."""
