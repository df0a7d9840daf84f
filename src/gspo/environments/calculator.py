"""The built-in ``calculator`` task's environment."""

from __future__ import annotations


class Calculator:
    """The built-in ``calculator`` task's environment: one tool, ``add``."""

    # where it is imported from: the spec a run records for the class given as itself
    # (config.yaml, the cold-start cache key) stays gspo.environments:Calculator
    __module__ = "gspo.environments"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum a + b.
        """
        return int(a) + int(b)
