"""The local training engine: one process, torch, CPU or one GPU."""
