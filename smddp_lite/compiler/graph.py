"""Graph compilation of the compiled step: torch.compile each repeated block on its own.

Why blocks and not the whole model: compiled whole, backward is one autograd node, so every
gradient is accumulated (and every post-accumulate-grad hook fires) only once all of backward is
done, and no bucket's collective could overlap it. Compiled block by block (as torchtitan compiles
transformer blocks), each block's backward is a node of its own: a block's gradients are
accumulated as soon as its backward ends, and the reducer sends their bucket while the blocks
before it still run backward. Identical blocks share one compiled graph (dynamo keys its cache by
the forward's code and guards on the block's class, not on the instance), so compile time is
about one block's.

What is compiled: the elements of every ``nn.ModuleList`` holding two or more modules of one
class with parameters (transformer layers, residual stages), outermost lists first. Each such
block's ``forward`` is replaced on the instance: parameter names, ``state_dict`` keys and hooks
on the block itself stay as they were (the hooks run eagerly around the graph, which is where the
sharded step waits for its gathers). Embeddings, heads and the loss stay eager.
"""

from __future__ import annotations

import importlib
import logging
import warnings

import torch

log = logging.getLogger("smddp_lite")

# set on a block whose forward this module replaced: compiling the model again keeps it
_MARK = "_smddp_graph_forward"


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to compile one by one, in definition order (see the module's docstring)."""
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: an outer list is seen before the lists in its blocks
        if id(module) in inside or not isinstance(module, torch.nn.ModuleList):
            continue
        by_class: dict[type, list[torch.nn.Module]] = {}
        for child in module:
            if any(True for _ in child.parameters()):
                by_class.setdefault(type(child), []).append(child)
        for same in by_class.values():
            if len(same) >= 2:
                blocks.extend(same)
                inside.update(id(m) for block in same for m in block.modules())
    return blocks


def compile_blocks(blocks: list[torch.nn.Module], debug: bool) -> None:
    """Replace each block's forward by its torch.compile'd self (once: a block compiled by an
    earlier ``smddp_lite.compile`` of the same model keeps its graph). ``debug``: torch's own
    log of graph breaks and recompiles, the two things that make a compiled step slow."""
    if debug:
        torch._logging.set_logs(graph_breaks=True, recompiles=True)
    if blocks:
        with warnings.catch_warnings():
            # inductor's first import defines torch.utils.mkldnn's classes with a torch.jit decorator
            # that torch itself deprecates: torch's own use, not ours, and nothing a user can change
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module("torch._inductor.compile_fx")
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        block.forward = torch.compile(block.forward)
        setattr(block, _MARK, True)


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Give every block of ``model`` its own eager forward back (compile again with
    ``torch_compile=False``)."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)


class ShapeWatch:
    """Says once, naming the argument, when a forward's input shape differs from the first one:
    each new shape compiles the blocks again (slow steps, until dynamo turns to a dynamic-shape
    graph that is slower than a static one)."""

    def __init__(self) -> None:
        self._first: dict[str, tuple[int, ...]] | None = None
        self._said = False

    def see(self, args: tuple, kwargs: dict) -> None:
        if self._said:
            return
        shapes = {f"argument {i}": tuple(a.shape) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        shapes.update({f"argument {k!r}": tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        if self._first is None:
            self._first = shapes
            return
        for name, shape in shapes.items():
            before = self._first.get(name)
            if before is not None and before != shape:
                self._said = True
                log.warning(
                    "smddp_lite.compile: the model's input %s changed shape from %s to %s; each new shape "
                    "compiles the model's blocks again (slow steps, then a slower dynamic-shape graph). Pad "
                    "inputs to a fixed shape (for text, a fixed sequence length: tokenizer padding=\"max_length\", "
                    "and drop_last=True in the DataLoader), or pass torch_compile=False.",
                    name, list(before), list(shape))
                return
