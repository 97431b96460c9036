"""`python -m artifacts.passes`: the registry's table (docs/passes.md holds it)."""

from . import table

print(table(), end="")
