"""``python -m gspo`` is the ``gspo`` command."""

from gspo.cli import entry

if __name__ == "__main__":
    entry()
