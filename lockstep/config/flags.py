"""Command-line flags generated from the config dataclasses, and the config's JSON form.

A field becomes a flag when its `metadata` carries a `Flag` (written `flag(...)`): the flag's
names, help text and the command lines that have it. Everything else argparse needs (type,
choices, repeatable, on/off switch, default) is read from the field's type and the current
value, so a setting is declared exactly once: in its dataclass field.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

import msgspec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("lockstep.config")
Config = TypeVar("Config", bound="DataclassInstance")
T = TypeVar("T")

Cli = Literal["serve", "scheduler", "gateway"]
SERVE: frozenset[Cli] = frozenset({"serve"})
SCHEDULER: frozenset[Cli] = frozenset({"serve", "scheduler"})  # serve forwards it
GATEWAY: frozenset[Cli] = frozenset({"serve", "gateway"})
EVERYWHERE: frozenset[Cli] = frozenset({"serve", "scheduler", "gateway"})
# The wiring between processes: `lockstep serve` fills it in itself.
SCHEDULER_ONLY: frozenset[Cli] = frozenset({"scheduler"})
GATEWAY_ONLY: frozenset[Cli] = frozenset({"gateway"})


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first is the canonical spelling (and the argparse dest)
    help: str
    clis: frozenset[Cli]
    metavar: str | None = None
    required: frozenset[Cli] = frozenset()  # must be given there (unless --config has it)
    deprecated: tuple[str, ...] = ()  # old spellings: still accepted, with a warning
    # The same setting in another unit: (flag, scale, help); the value is given * scale.
    scaled: tuple[tuple[str, float, str], ...] = ()

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def flag(
    *names: str,
    help: str,
    on: frozenset[Cli],
    metavar: str | None = None,
    required: frozenset[Cli] = frozenset(),
    deprecated: tuple[str, ...] = (),
    scaled: tuple[tuple[str, float, str], ...] = (),
) -> dict[str, Flag]:
    """Field metadata that makes the field a flag: `field(default=..., metadata=flag(...))`."""
    return {"flag": Flag(names, help, on, metavar, required, deprecated, scaled)}


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]  # attribute path from the root config, e.g. ("clock", "gather_s")
    flag: Flag
    hint: object  # the field's resolved type


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every flagged field under the dataclass `cls`, nested sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            yield from leaves(hint, (*prefix, f.name))
        elif "flag" in f.metadata:
            yield Leaf((*prefix, f.name), f.metadata["flag"], hint)


def get_path(obj: object, path: tuple[str, ...]) -> object:
    for name in path:
        obj = getattr(obj, name)
    return obj


def replace_paths(obj: Config, values: Mapping[tuple[str, ...], object]) -> Config:
    """A copy of the frozen dataclass `obj` with the values at these paths replaced."""
    here = {p[0]: v for p, v in values.items() if len(p) == 1}
    nested: dict[str, dict[tuple[str, ...], object]] = {}
    for p, v in values.items():
        if len(p) > 1:
            nested.setdefault(p[0], {})[p[1:]] = v
    for name, sub in nested.items():
        here[name] = replace_paths(getattr(obj, name), sub)
    return dataclasses.replace(obj, **here) if here else obj


def _unwrap_optional(hint: object) -> object:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _is_repeatable(hint: object) -> bool:
    return typing.get_origin(hint) is tuple


class _Argparse(TypedDict, total=False):
    """What a field's type says to argparse."""

    action: str
    type: Callable[[str], object]
    choices: list[object]
    metavar: str


_SCALARS: tuple[Callable[[str], object], ...] = (int, float, str, Path)


def _argparse_kwargs(hint: object) -> _Argparse:
    hint = _unwrap_optional(hint)
    if hint is bool:
        return {"action": "store_true"}
    if _is_repeatable(hint):
        item = typing.get_args(hint)[0]
        if item in _SCALARS:
            return {"action": "append", "type": item}
    if typing.get_origin(hint) is Literal:
        return {"choices": list(typing.get_args(hint))}
    for scalar in _SCALARS:
        if hint is scalar:
            return {"type": scalar}
    raise TypeError(f"no flag form for a field of type {hint!r}")


def _scaled(scale: float) -> Callable[[str], int]:
    def convert(text: str) -> int:
        return max(1, int(float(text) * scale))

    return convert


class _Deprecated(argparse.Action):
    """An old spelling: stores into the canonical dest and says which flag replaced it."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        new: str,
        convert: Callable[[str], object],
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest, help=help)
        self.new, self.convert = new, convert

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        log.warning("%s is deprecated; use %s", option_string, self.new)
        setattr(namespace, self.dest, self.convert(str(values)))


def add_flags(parser: argparse.ArgumentParser, root: object, cli: Cli) -> None:
    """Add every flag `cli` has; defaults are the values in `root` (a config instance)."""
    for leaf in leaves(type(root)):
        fl = leaf.flag
        if cli not in fl.clis:
            continue
        value = get_path(root, leaf.path)
        kwargs = _argparse_kwargs(leaf.hint)
        repeatable = kwargs.get("action") == "append"
        shown = "" if value in (None, False, ()) or repeatable else f" (default: {value})"
        help_text = fl.help.replace("%", "%%") + shown
        if fl.metavar is not None:
            kwargs["metavar"] = fl.metavar
        parser.add_argument(
            *fl.names,
            dest=fl.dest,
            default=None if repeatable else value,
            help=help_text,
            **kwargs,
        )
        convert = kwargs.get("type", str)
        for old in fl.deprecated:
            parser.add_argument(
                old,
                dest=fl.dest,
                action=_Deprecated,
                new=fl.names[0],
                convert=convert,
                help=f"deprecated spelling of {fl.names[0]}",
            )
        for name, scale, unit_help in fl.scaled:
            parser.add_argument(
                name,
                dest=fl.dest,
                type=_scaled(scale),
                help=unit_help,
            )


def from_namespace(root: Config, ns: argparse.Namespace, cli: Cli) -> Config:
    """`root` with every flag of `cli` set from the parsed namespace.

    Raises ValueError (a dataclass's own check, or a required flag missing)."""
    values: dict[tuple[str, ...], object] = {}
    for leaf in leaves(type(root)):
        if cli not in leaf.flag.clis:
            continue
        value = getattr(ns, leaf.flag.dest)
        if _is_repeatable(_unwrap_optional(leaf.hint)):
            if value is None:
                continue  # not given: keep the base value
            value = tuple(value)  # argparse's list of them
        values[leaf.path] = value
    cfg = replace_paths(root, values)
    for leaf in leaves(type(root)):
        if cli in leaf.flag.required and get_path(cfg, leaf.path) in (None, (), ""):
            raise ValueError(f"{leaf.flag.names[0]} is required")
    return cfg


def cli_surface(cls: type, cli: Cli) -> list[str]:
    """Every flag spelling `cli` accepts for a config of type `cls` (sorted)."""
    names: list[str] = []
    for leaf in leaves(cls):
        if cli in leaf.flag.clis:
            names += [*leaf.flag.names, *leaf.flag.deprecated, *(n for n, _, _ in leaf.flag.scaled)]
    return sorted(names)


# ---------------------------------------------------------------- the JSON form
def _enc_hook(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: object) -> object:
    if kind is Path and isinstance(obj, str):
        return Path(obj)
    raise NotImplementedError(f"cannot decode {kind!r}")


def to_json(cfg: object) -> bytes:
    return msgspec.json.encode(cfg, enc_hook=_enc_hook)


def from_json(data: bytes | str, cls: type[T]) -> T:
    """Decode (and validate: each dataclass's __post_init__ runs) a config written by to_json."""
    return msgspec.json.decode(data, type=cls, dec_hook=_dec_hook)
