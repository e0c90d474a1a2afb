"""Keep torch.compile's tracer (dynamo) out of the backend's own Python code.

A collective reaches this backend through C++ (DDP's reducer, c10d's functional collectives,
``dist.all_reduce`` itself), and the Python methods it calls are new frames to dynamo: under
``torch.compile(DDP(model))`` dynamo tried to compile ``ProcessGroupSMDDP``'s call router as a
graph of its own, where the group is an opaque object with a handful of registered members, and
its first attribute read (the small-call fast path's) was a hard error that ended every rank.
torch's own backends are C++ and never show dynamo a frame; this module makes ours the same:
every function of the backend's modules, and every function nested in them, runs as plain Python
with dynamo off for it and for everything it calls. It marks code objects through torch's C
eval-frame hook, so nothing here imports ``torch._dynamo`` (1.8 s) for a job that never compiles,
and a call pays nothing: the mark is read in C where dynamo meets the frame.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import torch

_PACKAGE = __name__.rpartition(".")[0]
_FOLDER = os.path.dirname(os.path.abspath(__file__)) + os.sep
_marked_modules: set[str] = set()


@functools.lru_cache(maxsize=None)
def _skip_strategy():
    """The eval-frame strategy "skip this frame and every frame it calls", or None on a torch
    without it (torch < 2.6 has no per-code strategy; there dynamo compiles these frames, as before)."""
    frame = getattr(torch._C, "_dynamo", None)
    frame = getattr(frame, "eval_frame", None)
    strategy, action = getattr(frame, "_FrameExecStrategy", None), getattr(frame, "_FrameAction", None)
    if strategy is None or action is None or not hasattr(frame, "set_code_exec_strategy"):
        return None
    return frame.set_code_exec_strategy, strategy(action.SKIP, action.SKIP)


def hide_backend_from_dynamo() -> None:
    """Mark every function of the backend's loaded modules that is not marked yet. Cheap to call
    again: a module is walked once, so callers call it wherever modules may have been loaded
    since (a group's creation, its first CUDA call)."""
    found = _skip_strategy()
    if found is None:
        return
    set_strategy, skip = found
    for name, module in list(sys.modules.items()):
        if module is None or name in _marked_modules or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        _marked_modules.add(name)
        for code in _codes_of(module):
            set_strategy(code, skip)


def _codes_of(module: types.ModuleType) -> set[types.CodeType]:
    """The code objects of every function defined in ``module``'s file: its functions, methods,
    properties and decorated functions, and the functions, lambdas and comprehensions inside them."""
    file = os.path.abspath(getattr(module, "__file__", None) or "")
    if not file.startswith(_FOLDER):
        return set()
    codes: set[types.CodeType] = set()
    seen: set[int] = set()
    pending = list(vars(module).values())
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.CodeType):
            if obj.co_filename == file and obj not in codes:
                codes.add(obj)
                pending.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, types.FunctionType):
            pending.append(obj.__code__)
            pending.append(getattr(obj, "__wrapped__", None))  # a wrapper's original
        elif isinstance(obj, type):
            if obj.__module__ == module.__name__:
                pending.extend(vars(obj).values())
        elif isinstance(obj, (staticmethod, classmethod)):
            pending.append(obj.__func__)
        elif isinstance(obj, property):
            pending.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, functools.partial):
            pending.append(obj.func)
        elif callable(obj) and hasattr(obj, "__wrapped__"):  # functools.wraps, lru_cache
            pending.append(obj.__wrapped__)
    return codes
