"""Model code shared by the training and sampling engines: the default tiny model, the base
model loader, multi-tenant LoRA and PEFT adapter files."""
