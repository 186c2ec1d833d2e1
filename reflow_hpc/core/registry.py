"""Name → class tables behind ``@register_sampler`` and ``@register_replay_filter``.

A config key holds a name; the registry turns it into a class. Registering is the only step a user
takes to add an implementation: decorate the class, then put its name in the config.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str):
        self.kind = kind                # "replay sampler", used in errors
        self.config_key = config_key    # the config key that selects one, used in errors
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(cls: T) -> T:
            known = self._classes.get(name)
            if known is not None and known is not cls:
                raise ValueError(f'{self.kind} "{name}" is already registered by '
                                 f"{known.__module__}.{known.__qualname__}; pick another name")
            cls.name = name
            self._classes[name] = cls
            return cls

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f'{self.config_key} = "{name}": unknown {self.kind}; registered: '
                             + ", ".join(sorted(self._classes))) from None

    def names(self) -> list[str]:
        return sorted(self._classes)
