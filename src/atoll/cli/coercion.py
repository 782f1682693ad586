"""Typer's per-parameter coercion, made lazy so that a plain command never imports pydantic.

typer 0.29 coerces every non-flag parameter through a pydantic `TypeAdapter`, built for each
parameter of the command being run even when its value is None (an option left out). Importing
pydantic and building those adapters costs ~100 ms, about half of what `atoll sandbox exec ID --
true` spends before it sends its request. `install()` (called by atoll.cli.main at import) wraps
typer's `build_runtime_param` so that:

- an option left out (None) never builds an adapter (typer's own `RuntimeParam.coerce` answers
  None or () for it before asking the adapter);
- a `str` or `list[str]` value given as plain strings (argv, environment) is returned as typer's
  adapter would return it (the string itself; a list of the strings), without pydantic;
- every other value (numbers, enums, bytes, paths, files, custom parsers) goes to the adapter typer
  builds, on first use, so its coercion and error messages are typer's own.

tests/unit/test_cli_coercion.py checks the shortcut against typer's adapter for the parameters of
every atoll command, so a typer upgrade that changes either side fails there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typer import _coercion, core

_ORIGINAL = _coercion.build_runtime_param


@dataclass(frozen=True)
class DeferredRuntimeParam(_coercion.RuntimeParam):
    """A parameter's coercion: plain strings directly, anything else through typer's own."""

    descriptor: _coercion.TypeDescriptor

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        plain = shortcut(self.descriptor, value)
        if plain is not None:
            return plain
        return self.real()._coerce_value(value, param=param, ctx=ctx)

    def real(self) -> _coercion.RuntimeParam:
        built = self.__dict__.get("_real")
        if built is None:
            built = _ORIGINAL(self.descriptor)
            object.__setattr__(self, "_real", built)  # frozen dataclass: a cache, not state
        return built


def shortcut(descriptor: _coercion.TypeDescriptor, value: Any) -> Any:
    """What typer's adapter returns for `value`, when that needs no pydantic; else None."""
    if descriptor.parameter_info.parser is not None:
        return None
    if descriptor.annotation is str and type(value) is str:
        return value
    if descriptor.annotation == list[str] and isinstance(value, (list, tuple)):
        if all(type(item) is str for item in value):
            return list(value)
    return None


def build_runtime_param(descriptor: _coercion.TypeDescriptor) -> _coercion.RuntimeParam:
    if descriptor.file_annotation is not None:
        return _ORIGINAL(descriptor)
    return DeferredRuntimeParam(
        parameter_info=descriptor.parameter_info, annotation=descriptor.annotation, descriptor=descriptor
    )


def install() -> None:
    """Make typer's parameters use `build_runtime_param` (idempotent)."""
    core.build_runtime_param = build_runtime_param  # type: ignore[attr-defined]
