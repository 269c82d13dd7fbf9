"""Server-side custom losses, one module per role.

- `graph`: the loss as data (no torch): the allowlist, the structural check at creation
  (`build_loss`) and the check of a datum's inputs against the loss (`check_datum`).
- `bound`: what one datum's loss may cost (no torch), from the model and the trainer's budget.
- `program`: the graph rebuilt from a fixed table of callables and run (`run`, `evaluate`).
- `pricing`: the program on meta tensors under a FLOP and memory counter, per shape bucket.

The scheduler checks, prices and stores them (`scheduler/state/custom_losses.py`); the engines
run the program (`training/pass_result.py`).
"""
