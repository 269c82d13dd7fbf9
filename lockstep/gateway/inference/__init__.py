"""Text-in, text-out inference for the OpenAI- and Anthropic-compatible routes.

The routes take text (or token ids) and return text, so the gateway tokenizes and detokenizes
(`codec.py`, the served model's own tokenizer and chat template, loaded from its directory like
the SDK's `get_tokenizer()` does on the client side); everything else is the Tinker sampling path:
`lane.py` turns a request into the same sampler session + `Sample` submission + future the
`/api/v1/asample` route makes, so these requests are batched with Tinker samples on the same
engines, under the same keys and ownership rules.
"""
