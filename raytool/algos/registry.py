"""A name -> function registry, so that configs pick algorithms by name and users add their own."""

from __future__ import annotations


class Registry(dict):
    def __init__(self, what: str):
        super().__init__()
        self.what = what  # e.g. "advantage estimator", for error messages

    def register(self, name: str):
        """Decorator: `@ADV_ESTIMATORS.register("grpo")`."""

        def wrap(fn):
            self[name] = fn
            return fn

        return wrap

    def lookup(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} '{name}'; registered: {sorted(self)}") from None
