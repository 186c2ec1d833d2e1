"""Name → class tables behind ``@register_sampler`` and ``@register_replay_filter``.

A config key holds a name; the registry turns it into a class, and the class into a configured
instance. Registering is the only step a user takes to add an implementation: decorate the class,
then put its name in the config.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Generic, Self, TypeVar


class Registered(abc.ABC):
    """What a registry holds: a class that knows the name it was registered under and builds itself
    from the config section that selects it."""

    name: ClassVar[str] = ""

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        """Build from the ``[reflow]`` config section (attribute access only); the default takes no
        parameters."""
        return cls()


C = TypeVar("C", bound=Registered)


class Registry(Generic[C]):
    def __init__(self, kind: str, config_key: str):
        self.kind = kind                # "replay sampler", used in errors
        self.config_key = config_key    # the config key that selects one, used in errors
        self._classes: dict[str, type[C]] = {}

    def register(self, name: str) -> Callable[[type[C]], type[C]]:
        """Class decorator: make the class selectable as ``config_key = name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(cls: type[C]) -> type[C]:
            known = self._classes.get(name)
            if known is not None and known is not cls:
                raise ValueError(f'{self.kind} "{name}" is already registered by '
                                 f"{known.__module__}.{known.__qualname__}; pick another name")
            cls.name = name
            self._classes[name] = cls
            return cls

        return decorate

    def get(self, name: str) -> type[C]:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f'{self.config_key} = "{name}": unknown {self.kind}; registered: '
                             + ", ".join(sorted(self._classes))) from None

    def make(self, name: str, settings: Any = None) -> C:
        """A fresh instance of the class registered as ``name``, configured from ``settings`` (the
        ``[reflow]`` config section) when given."""
        cls = self.get(name)
        return cls.from_settings(settings) if settings is not None else cls()

    def names(self) -> list[str]:
        return sorted(self._classes)
