"""Errors every layer shares: the gateway, the scheduler and the engines raise and read them.

A neutral leaf (it imports nothing of lockstep), so validation code anywhere can raise a
`UserInputError` without depending on the engine contract or on a process package.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input from a user: reported as a 400 / a future error with category "user".

    `field` names the offending request field so the message can point at it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message

    def __reduce__(self) -> tuple[type[UserInputError], tuple[str, str]]:
        # Engines run in child processes: the error must survive the trip back.
        return (UserInputError, (self.field, self.detail))


class UnsupportedModel(ValueError):
    """The base model has a feature Lockstep cannot compute exactly, or that an engine would
    serve differently from how it is trained; the message names it (`modeling.architecture`)."""
