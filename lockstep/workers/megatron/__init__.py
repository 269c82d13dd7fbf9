"""Megatron-core training engine: TP / PP / DP worker groups on Ray (docs/megatron.md)."""
