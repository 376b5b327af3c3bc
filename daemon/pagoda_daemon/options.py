"""How an option is declared once and everything else is generated from it.

An option is a dataclass field made with :func:`option`: its type annotation, default,
help text, allowed values, lower bound and the capability a non-default value needs live
in that one place. From the fields come the command line flags (:func:`add_cli_args`), the
keyword arguments back from parsed flags (:func:`values_from_args`), the checks of values
read from a ``--config`` file (:func:`check_value`) and the bound checks at construction
(:func:`check_bounds`). vLLM's ``EngineArgs.add_cli_args`` is the model.

Standard library only: ``pagoda operator`` builds these flags in an image without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pagoda_daemon import capabilities

_KEY = "pagoda.option"
# The exit status of a `pagoda` command that refuses what it was given (options, a model, a
# layout), saying why in one line on stderr; the operator reads it off a pod (status.py).
EXIT_REFUSED = 2


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None  # inclusive, unless exclusive_minimum
    exclusive_minimum: bool = False
    maximum: float | None = None
    cli: bool = True  # False: set by the program, not a flag (the model path, derived options)
    needs: str | None = None  # a capability that any value other than the default needs
    many: bool = False  # a string flag that takes several values (and may repeat): one line each


def option(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, minimum: float | None = None,
           exclusive_minimum: bool = False, maximum: float | None = None, cli: bool = True,
           needs: str | None = None, many: bool = False) -> Any:
    """A dataclass field that is also a declared option."""
    info = OptionInfo(help, choices, minimum, exclusive_minimum, maximum, cli, needs, many)
    return dataclasses.field(default=default, metadata={_KEY: info})


@dataclasses.dataclass(frozen=True)
class Declared:
    """One option as read back from its dataclass: name, Python type, default, metadata."""

    name: str
    type: type
    nullable: bool
    default: Any
    info: OptionInfo

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """The declared options of a dataclass (read once per class: evaluating its type hints is
    the costly part, and every construction and every operator validation asks)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        info = f.metadata.get(_KEY)
        if info is None:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else hint
        out.append(Declared(f.name, base, type(None) in typing.get_args(hint), f.default, info))
    return tuple(out)


def _value_of(values: object | Mapping[str, Any], name: str, default: Any = None) -> Any:
    """An option's value from a dataclass instance, parsed flags or a mapping of options."""
    return values.get(name, default) if isinstance(values, Mapping) else getattr(values, name, default)


def add_cli_args(group: argparse._ActionsContainer, cls: type) -> None:
    """One flag per declared option (booleans get --x/--no-x), defaults from the declaration."""
    for d in declared(cls):
        if not d.info.cli:
            continue
        shown = "" if d.default is None else f" (default: {d.default})"
        if d.type is bool:
            group.add_argument(d.flag, action=argparse.BooleanOptionalAction, default=d.default,
                               help=d.info.help + shown)
        elif d.info.many:
            group.add_argument(d.flag, nargs="+", action=_JoinLines, default=d.default, help=d.info.help + shown)
        else:
            group.add_argument(d.flag, type=_parser_for(d), default=d.default, choices=d.info.choices,
                               help=d.info.help + shown)


class _JoinLines(argparse.Action):
    """``--flag A B --flag C``: the string "A\\nB\\nC" (one line per value, as in a config file)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        earlier = getattr(namespace, self.dest, None)
        lines = ([earlier] if earlier and earlier != self.default else []) + list(values or [])
        setattr(namespace, self.dest, "\n".join(lines))


def _parser_for(d: Declared) -> Callable[[str], Any]:
    if d.type is float:
        return _finite_float
    return d.type


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def values_from_args(args: argparse.Namespace | Mapping[str, Any], cls: type) -> dict[str, Any]:
    """The declared options' values out of parsed flags (or a resolved options mapping)."""
    return {d.name: _value_of(args, d.name, d.default) for d in declared(cls) if d.info.cli}


def check_value(d: Declared, value: Any, where: str) -> Any:
    """A value from a --config file: the declared type exactly (an int is accepted for a
    float; nothing else is converted), else ValueError naming the option."""
    if value is None and d.nullable:
        return None
    ok = (
        (d.type is bool and isinstance(value, bool))
        or (d.type is int and isinstance(value, int) and not isinstance(value, bool))
        or (d.type is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (d.type is str and isinstance(value, str))
    )
    if not ok:
        raise ValueError(f"{where}: {d.name} must be {d.type.__name__}{' or null' if d.nullable else ''}, "
                         f"not {type(value).__name__} {value!r}")
    return float(value) if d.type is float else value


def check_bounds(obj: object, supports: Callable[[str], bool] = capabilities.supported) -> None:
    """Allowed values and bounds of every declared option of a dataclass instance, then the
    capabilities its non-default values need (ValueError naming the flag)."""
    cls: type = type(obj)
    for d in declared(cls):
        value = getattr(obj, d.name)
        if value is None:
            if not d.nullable:
                raise ValueError(f"{d.name} must be set")
            continue
        if d.type is float and not math.isfinite(value):
            raise ValueError(f"{d.name} must be a finite number, got {value}")
        if d.info.choices is not None and value not in d.info.choices:
            raise ValueError(f"{d.name} must be one of {d.info.choices}, got {value!r}")
        lo, hi = d.info.minimum, d.info.maximum
        if lo is not None and (value <= lo if d.info.exclusive_minimum else value < lo):
            raise ValueError(f"{d.name} must be {'greater than' if d.info.exclusive_minimum else 'at least'} "
                             f"{lo}, got {value}")
        if hi is not None and value > hi:
            raise ValueError(f"{d.name} must be at most {hi}, got {value}")
    message = refusal_message(obj, supports=supports)
    if message:
        raise ValueError(message)


def refusals(obj: object | Mapping[str, Any], cls: type | None = None,
             supports: Callable[[str], bool] = capabilities.supported) -> dict[str, str]:
    """Option name -> the capability it lacks, for the declared options whose value needs a
    capability this build does not have (read by the daemon's start and the operator's validation)."""
    return {
        d.name: d.info.needs
        for d in declared(cls or type(obj))
        if d.info.needs and not supports(d.info.needs)
        and _value_of(obj, d.name, d.default) not in (d.default, None)
    }


def refusal_message(obj: object | Mapping[str, Any], cls: type | None = None,
                    supports: Callable[[str], bool] = capabilities.supported) -> str | None:
    """The daemon's refusal of every unsupported option in one line, by flag name."""
    refused = refusals(obj, cls, supports)
    if not refused:
        return None
    return "; ".join(f"--{name.replace('_', '-')}={_value_of(obj, name)}: {capabilities.refusal(cap)}"
                     for name, cap in refused.items())
