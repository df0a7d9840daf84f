"""Out of memory, said in one line: what ran out, and what lowers the memory.

:class:`OutOfMemory` is the error (a ``ValueError``, so the CLI ends with it as one line);
:func:`is_out_of_memory` recognises CUDA's, the CPU allocator's and Python's. Loading a
model says which model, in which dtype, onto which device, and what lowers it
(:func:`gspo.models.loading.loading_model`); the stages of a run say theirs
(:mod:`gspo.training.memory`).
"""

from __future__ import annotations

import re

import torch


class OutOfMemory(ValueError):
    """The device ran out of memory in one stage of a run; the message names the settings
    that lower that stage's memory. A ``ValueError``, so the CLI ends with it as one line
    (exit status 2)."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is running out of memory: torch's ``OutOfMemoryError`` (CUDA), the
    ``RuntimeError`` of its CPU allocator (``DefaultCPUAllocator: can't allocate memory``)
    or Python's ``MemoryError``."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)


def what_ran_out(error: BaseException) -> str:
    """torch's first sentence (``CUDA out of memory``) and the allocation it tried."""
    text = str(error)
    cpu = re.search(r"tried to allocate (\d+) bytes", text)
    if isinstance(error, MemoryError) or cpu or "DefaultCPUAllocator" in text:
        said = "out of CPU memory"
        return f"{said} (tried to allocate {int(cpu.group(1)) / 2**30:.2f} GiB)" if cpu else said
    said = text.split(".")[0].strip() or "out of memory"
    size = re.search(r"Tried to allocate ([\d.]+ ?[KMGTP]?i?B)", text)
    return f"{said} (tried to allocate {size.group(1)})" if size else said
