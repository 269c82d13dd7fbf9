"""Model code shared by the training and sampling engines: the default tiny model, the base
model loader, multi-tenant LoRA and PEFT adapter files."""

from lockstep.modeling import transformers_range

# Before any module here imports a part of transformers: a release outside the supported range
# is refused by its version, not by the first missing module.
transformers_range.check()
