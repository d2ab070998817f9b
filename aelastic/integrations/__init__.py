"""Integrations with other tools (torchrun). Each submodule imports its tool lazily."""

__all__: list[str] = []
