"""User datasets: where a dataset's rows come from and what each row becomes.

- :mod:`~gspo.data.sources`: ``data.train``, ``data.eval``, ``data.sft`` (a file, a
  directory, a hub id) to rows (:func:`load_rows`, :func:`parse_source`);
- :mod:`~gspo.data.files`: a data file's rows (JSON Lines, JSON, CSV, Parquet, values as
  written), a row's field by a dotted path (:func:`field_of`);
- :mod:`~gspo.data.prompts`: rows to prompts, answers and cold-start completions
  (:func:`prepare_rows`, :func:`not_an_answer`).

The built-in procedurally generated tasks are :mod:`gspo.tasks`.
"""

from gspo.config.data import template_fields
from gspo.data.files import Row as Row
from gspo.data.files import field_of as field_of
from gspo.data.files import written_messages as written_messages
from gspo.data.prompts import not_an_answer, prepare_rows
from gspo.data.sources import load_rows, parse_source

__all__ = ["load_rows", "not_an_answer", "parse_source", "prepare_rows", "template_fields"]
