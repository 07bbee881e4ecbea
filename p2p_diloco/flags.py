"""Configuration fields <-> command-line flags, for every role: one flag per field of a pydantic
model (``--section-field-name``), defaults then a TOML file then flags (:func:`build_config`), flags
back from a configuration (:func:`flags_of`, used by ``to_flags``) and a validated configuration
from flags in a launcher's own process (:func:`parse_flags`). Errors are
:class:`~p2p_diloco.errors.ConfigError` naming the field, its flag and the value given.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pydantic import BaseModel, ValidationError

from p2p_diloco.errors import ConfigError

ALIASES: dict[tuple[str, ...], list[str]] = {
    ("data", "path"): ["--data"],
    ("data", "tokenizer"): ["--tokenizer"],
    ("model", "preset"): ["--preset"],
    ("model", "path"): ["--model"],
}


def flag_for(path: tuple[str, ...]) -> str:
    """The command-line flag of a config field, e.g. ``("outer", "period")`` -> ``--outer-period``."""
    return "--" + "-".join(part.replace("_", "-") for part in path)


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], prefix: tuple[str, ...] = ()) -> None:
    """Add one flag per field of ``model`` (recursing into sections) to ``parser``.

    Values stay strings (pydantic converts and validates them, so errors name the field); flags
    that are not given leave no attribute, so TOML values and defaults survive.
    """
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        annotation = _unwrap_optional(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            # the docstring's first sentence (argparse appends a colon)
            title = re.split(r"\.\s+(?=[A-Z])", " ".join(annotation.__doc__.split()))[0].rstrip(".")
            group = parser.add_argument_group(f"[{name}] {title}")
            add_config_arguments(group, annotation, path)
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flags = list(extra.get("flags", [flag_for(path)])) + ALIASES.get(path, [])
        dest = "cfg__" + "__".join(path)
        default = field.get_default(call_default_factory=True)
        help_text = (field.description or "") + (f" (default: {default})" if default not in ("", None, []) else "")
        kwargs: dict[str, Any] = dict(dest=dest, default=argparse.SUPPRESS, help=help_text)
        origin = typing.get_origin(annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            kwargs["nargs"] = "+"
            kwargs["metavar"] = name.upper().rstrip("S")
        elif origin is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        else:
            kwargs["metavar"] = {int: "N", float: "X", str: "TEXT"}.get(annotation, "VALUE")
        parser.add_argument(*flags, **kwargs)


def _cli_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, value in vars(namespace).items():
        if not key.startswith("cfg__"):
            continue
        node = overrides
        *parents, leaf = key[len("cfg__") :].split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return overrides


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file; raises ConfigError if it is missing or malformed."""
    file = Path(path)
    try:
        with file.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist")
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable (permission denied)")
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, expected a .toml file")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}")


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field (dotted), its flag and the value given."""
    lines = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if loc:
            given = item.get("input")
            given_text = "" if isinstance(given, dict) else f" (got {given!r})"
            lines.append(f"invalid {'.'.join(loc)} ({flag_for(loc)}): {message}{given_text}")
        else:
            lines.append(f"invalid configuration: {message}")
    return "; ".join(lines)


def flags_of(config: BaseModel, prefix: tuple[str, ...] = ()) -> list[str]:
    """Flags that rebuild ``config`` (one per field that differs from its default, sections
    recursed); ``prefix``: where it sits in a larger configuration.

    :raises ValueError: for a value no flag can express (an empty list where the default is not)
    """
    flags: list[str] = []
    for name, field in type(config).model_fields.items():
        path, value = prefix + (name,), getattr(config, name)
        if isinstance(value, BaseModel):
            flags += flags_of(value, path)
            continue
        if value == field.get_default(call_default_factory=True):
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = list(extra.get("flags", [flag_for(path)]))[0]
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            if not value:
                raise ValueError(f"{'.'.join(path)}: an empty list cannot be given as a flag")
            flags += [flag, *(str(item) for item in value)]
        elif value is not None:
            flags += [flag, repr(value) if isinstance(value, float) else str(value)]
    return flags


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes raise ConfigError instead of exiting."""

    def error(self, message: str):
        raise ConfigError(f"invalid flags: {message}")


def parse_flags(model: type[BaseModel], flags: Sequence[str], base: Optional[BaseModel] = None) -> Any:
    """A validated ``model`` from command-line flags (as ``p2p-diloco`` reads them), applied on top of
    ``base`` (default: the model's defaults). The inverse of :func:`flags_of`: launchers
    build a config from flags in their own process, so a typo or a renamed flag fails at once.

    :raises ConfigError: an unknown flag or an invalid value (the message names the field and flag)
    """
    parser = _Parser(prog=model.__name__, add_help=False, allow_abbrev=False)
    add_config_arguments(parser, model)
    namespace = parser.parse_args(list(flags))
    data = _deep_merge(base.model_dump() if base is not None else {}, _cli_overrides(namespace))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def section_from_args(model: type[BaseModel], namespace: argparse.Namespace, prefix: tuple[str, ...]) -> Any:
    """The validated ``model`` from the flags that ``add_config_arguments(parser, model, prefix)``
    added (e.g. a benchmark's ``--inner-*`` flags, under the islands' names).

    :raises ConfigError: an invalid value (the message names the field and its flag)
    """
    data = _cli_overrides(namespace)
    for part in prefix:
        data = data.get(part, {})
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e).replace("invalid ", f"invalid {'.'.join(prefix)}.")) from None


def build_config(model: type[BaseModel], namespace: argparse.Namespace, config_file: str = "") -> Any:
    """Defaults, then the TOML file, then flags; returns a validated ``model`` or raises ConfigError."""
    data = load_toml(config_file) if config_file else {}
    data = _deep_merge(data, _cli_overrides(namespace))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
