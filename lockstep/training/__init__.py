"""Training kernels shared by every training engine (local torch, Megatron): the torch losses and
target logprobs, batched AdamW with gradient clipping, and the training-state checkpoint files.

Why a package of its own: the engines under `workers/` are backends; what must compute the same
numbers in each of them lives here once. It depends on `engine/` (types, the loss table) and
`modeling/` (adapter rules and PEFT files, which the samplers share too), never on a backend.
"""
