"""Graph compilation of the compiled step: torch.compile each repeated block on its own, and the
model around them split at every block.

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
sharded step waits for its gathers). The model's own forward is compiled too, with each block
opaque to it: dynamo splits it at every block into graphs of their own (the embeddings before the
first block, the head and a loss the model computes after the last), as torch's DDPOptimizer
splits a graph at bucket boundaries. Without such a list nothing is compiled: one graph of the
whole model would hold every gradient back to the end of backward.
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


def compile_graphs(model: torch.nn.Module, blocks: list[torch.nn.Module], debug: bool) -> list[torch.nn.Module]:
    """Replace each block's forward by its torch.compile'd self, and ``model``'s forward by one
    that compiles everything around the blocks (embeddings, head, loss) into graphs of their own:
    the blocks are opaque to it (``_opaque``: each block runs its own graph), so
    dynamo splits the model's forward at every block, as torch's DDPOptimizer splits at buckets,
    and every piece's backward is an autograd node whose gradients go out as soon as it ends.
    Returns what was compiled, blocks first, each running its own hooks eagerly. Once per module:
    a module compiled by an earlier ``smddp_lite.compile`` keeps its graph. ``debug``: torch's own
    log of graph breaks and recompiles, the two things that make a compiled step slow."""
    if not blocks:
        return []
    if debug:
        torch._logging.set_logs(graph_breaks=True, recompiles=True)
    with warnings.catch_warnings():
        # inductor's first import defines torch.utils.mkldnn's classes with a torch.jit decorator
        # that torch itself deprecates: torch's own use, not ours, and nothing a user can change
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("torch._inductor.compile_fx")
    for block in blocks:
        if not getattr(block, _MARK, False):
            block.forward = _opaque(torch.compile(block.forward))
            setattr(block, _MARK, True)
    if not getattr(model, _MARK, False):
        model.forward = torch.compile(model.forward)
        setattr(model, _MARK, True)
    return [*blocks, model]


def _opaque(compiled):
    """``compiled``, run as a graph of its own where an enclosing graph calls it: dynamo does not
    inline this frame (a graph break), and the frames it calls are compiled as usual, so
    ``compiled`` runs its own graph (``recursive=True`` would run it eagerly)."""

    def run_own_graph(*args, **kwargs):
        return compiled(*args, **kwargs)

    return torch.compiler.disable(run_own_graph, recursive=False)


def uncompile_graphs(model: torch.nn.Module) -> None:
    """Give ``model`` and every block of it its own eager forward back (compile again with
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
