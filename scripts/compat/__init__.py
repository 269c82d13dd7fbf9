"""The probes behind scripts/compat_matrix.py (one module per table)."""
