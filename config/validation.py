"""Config values checked against config.sections' schemas, and the one-line error that names a bad key.

`validate(schema, value, path)` gives the validated value or raises `ConfigError` naming the key path of the
first invalid value, in the Coordinator's words ("must be an integer"). config.load reads whole files with
it, config.pymotor MindIE-PyMotor's sections, and the deployer its own keys.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, get_type_hints

from pydantic import AliasChoices, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

# What pydantic's own error types say, in the Coordinator's words. Bounds come with their value (ctx).
_WHY = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "dataclass_type": "must be an object",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "missing": "is required",
}
_CONTAINERS = ("missing", "dataclass_type", "tuple_type", "list_type", "dict_type")  # errors of the object around


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the key path. `value` holds the value refused,
    where one key's value is (the deployer quotes it)."""

    def __init__(self, message: str, *value: Any):
        super().__init__(message)
        self.value = value  # () or (the value,)


def refusal(error: ErrorDetails, path: str) -> ConfigError:
    """One line for pydantic's error in the value at key path `path`: `<path>.<key path>: <why>`."""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "refused":  # a check of config.sections, in its own words
        why = ctx["why"]
        if ctx["key"]:  # a rule of the whole object: its input is no one key's value
            return ConfigError(f"{path}.{ctx['key']}: {why}")
    elif kind == "greater_than_equal":
        why = f"must be >= {ctx['ge']}"
    elif kind == "greater_than":
        why = f"must be > {ctx['gt']:g}"
    else:
        why = _WHY.get(kind, error["msg"])
    if kind in _CONTAINERS:  # no one key's value
        return ConfigError(f"{path}: {why}")
    return ConfigError(f"{path}: {why}", error["input"])


@cache
def adapter(schema: Any) -> TypeAdapter:
    return TypeAdapter(schema)  # built on first use: the workers, which read no config file, never build one


def validate(schema: Any, value: Any, path: str) -> Any:
    """`value` validated against a schema of config.sections, or ConfigError naming the first invalid key under
    `path`, the key path of `value` (motor_coordinator_config.api_config)."""
    try:
        return adapter(schema).validate_python(value)
    except ValidationError as e:
        raise refusal(e.errors(include_url=False)[0], path) from None


@cache
def config_keys(cls: type) -> dict[str, tuple[str, ...]]:
    """{attribute: the config keys that set it} of a section dataclass."""
    hints = get_type_hints(cls, include_extras=True)
    keys = {}
    for f in dataclasses.fields(cls):
        names: tuple[str, ...] = (f.name,)
        for meta in getattr(hints[f.name], "__metadata__", ()):
            if isinstance(meta, FieldInfo) and isinstance(meta.validation_alias, AliasChoices):
                names = tuple(str(c) for c in meta.validation_alias.choices)
            elif isinstance(meta, FieldInfo) and meta.alias:
                names = (meta.alias,)
        keys[f.name] = names
    return keys


def config_key(cls: type, attr: str) -> str:
    """The config key of one attribute of a section dataclass."""
    return config_keys(cls)[attr][0]
