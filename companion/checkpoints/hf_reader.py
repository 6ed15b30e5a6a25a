"""Read the fields of a transformers config, collecting what is missing or mistyped
(chapters 05-13).

:func:`companion.checkpoints.transformers_config.config_from_hf` and every family
function of :mod:`companion.checkpoints.hf_families` read ``hf_model.config`` through one
:class:`ConfigReader`: ``r.integer("num_experts")``, ``r.number("rms_norm_eps")``,
``r.sequence("layer_types")``, ``r.mapping("rope_parameters")``, each with an optional
default for a field that may be absent (or None), and build config groups with
``r.make(MoEConfig, ...)``. A missing field, or one holding None or
a value of the wrong type, is recorded in ``ConfigReader.problems`` and a harmless
stand-in is returned (and :meth:`ConfigReader.make` builds nothing more), so that the
family function runs to its end and the caller raises
one error naming every bad field (:meth:`ConfigReader.raise_problems`), not an
AttributeError from deep inside a family.

Kinds of value: ``integer`` (an int, not a bool), ``number`` (a finite int or float),
``text`` (a str), ``flag`` (a bool, an int or None, read as a bool), ``sequence`` (a list
or tuple, returned as a list), ``mapping`` (a dict-like, returned as a dict).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["REQUIRED", "ConfigReader"]

T = TypeVar("T")
REQUIRED = object()  # the default of a field that must be present and not None


def _is_integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# kind -> (accepts a value, what it must be, the stand-in returned for a bad value)
_KINDS: dict[str, tuple[Callable[[object], bool], str, object]] = {
    "integer": (_is_integer, "an integer", 1),
    "number": (_is_number, "a finite number", 1.0),
    "text": (lambda v: isinstance(v, str), "a string", ""),
    "flag": (lambda v: v is None or isinstance(v, int), "a bool", False),
    "sequence": (lambda v: isinstance(v, (list, tuple)), "a list", ()),
    "mapping": (lambda v: isinstance(v, Mapping), "a mapping", {}),
}
_CONVERT: dict[str, Callable[[Any], object]] = {
    "flag": bool,
    "sequence": list,
    "mapping": dict,
}


class ConfigReader:
    """Typed access to the fields of one transformers config (or any object with the
    same attributes); ``problems`` lists each field that is missing or bad."""

    def __init__(self, hf_config: object) -> None:
        self.config = hf_config
        self.problems: list[str] = []

    def has(self, name: str) -> bool:
        """True if the config has a field ``name`` (whatever its value)."""
        return hasattr(self.config, name)

    def get(self, name: str, default: object = None) -> object:
        """The field ``name`` as it is, ``default`` if absent (no type check)."""
        return getattr(self.config, name, default)

    def integer(self, name: str, default: object = REQUIRED) -> Any:
        """The int ``name`` (``default`` if absent or None, when given)."""
        return self._field(name, "integer", default)

    def number(self, name: str, default: object = REQUIRED) -> Any:
        """The int or float ``name`` as stored (``default`` if absent or None)."""
        return self._field(name, "number", default)

    def text(self, name: str, default: object = REQUIRED) -> Any:
        """The str ``name`` (``default`` if absent or None)."""
        return self._field(name, "text", default)

    def flag(self, name: str, default: object = REQUIRED) -> Any:
        """The bool ``name`` (``default`` if absent)."""
        if default is not REQUIRED and not self.has(name):
            return default
        return self._field(name, "flag", REQUIRED)

    def sequence(self, name: str, default: object = REQUIRED, of: str = "") -> Any:
        """The list or tuple ``name`` as a list (``default`` if absent or None); with
        ``of``, each entry must be of that kind (e.g. ``"text"``)."""
        value = self._field(name, "sequence", default)
        if of and isinstance(value, list):
            ok, what, _ = _KINDS[of]
            bad = [v for v in value if not ok(v)]
            if bad:
                self._bad(f"{name} entries {bad!r} (each must be {what})")
                return []
        return value

    def mapping(self, name: str, default: object = REQUIRED) -> Any:
        """The mapping ``name`` as a dict (``default`` if absent or None)."""
        return self._field(name, "mapping", default)

    def entry(
        self,
        where: str,
        table: Mapping,
        key: str,
        kind: str,
        default: object = REQUIRED,
    ) -> Any:
        """``table[key]`` checked as ``kind``; ``where`` names the table in a problem
        (e.g. ``"rope_parameters['main']"``)."""
        return self._check(
            f"{where}[{key!r}]", key in table, table.get(key), kind, default
        )

    def make(
        self, factory: Callable[..., T], *args: object, **kwargs: object
    ) -> T | None:
        """``factory(*args, **kwargs)`` (e.g. a config group), or None once a field
        read so far is bad: its stand-in could make the group invalid, and the bad
        field is the error to report."""
        return None if self.problems else factory(*args, **kwargs)

    def _field(self, name: str, kind: str, default: object) -> Any:
        value = getattr(self.config, name, None)
        return self._check(name, self.has(name), value, kind, default)

    def _check(
        self, name: str, present: bool, value: object, kind: str, default: object
    ) -> Any:
        ok, what, stand_in = _KINDS[kind]
        if default is not REQUIRED and (not present or value is None):
            return default
        if not present:
            self._bad(f"{name} (missing; must be {what})")
            return stand_in
        if not ok(value):
            self._bad(f"{name}={value!r} (must be {what})")
            return stand_in
        return _CONVERT.get(kind, lambda v: v)(value)

    def _bad(self, problem: str) -> None:
        if problem not in self.problems:  # a field read twice is named once
            self.problems.append(problem)

    def raise_problems(self, arch: str) -> None:
        """Raise one ValueError naming ``arch`` and every missing or bad field read so
        far; nothing if there is none."""
        if self.problems:
            raise ValueError(
                f"{arch}: the config cannot be read; missing or wrong-typed fields: "
                + ", ".join(self.problems)
            )
