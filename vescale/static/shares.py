"""Each module body's share of a gradient, read off autograd's own nodes while recording.

A static body gets its inputs and parameters as local tensors, so in a static step autograd hands it
the gradient its own ops make for each of them, and the boundary passes that on laid out as DTensor's
backward laid out the body's share while recording. The recording used to see that share through an
alias node per body input and parameter (a view of its own, whose gradient is what the body's ops
hand back). Such a node changes the step's numbers: autograd sums a tensor's gradients in the order
they arrive, and an alias first sums the body's own uses, then adds that to the other consumers'
gradients, where eager mode (and a static step, whose quiet modules have no node at their boundary)
adds each use as it arrives: ``(a + b) + c`` against ``a + (b + c)``, which differ in the last bit
of fp32. A decoder layer's residual stream is such a tensor (the norm uses it twice, the residual
add once), so every recording step's gradients were a few ulps off eager mode's.

So the recording adds no node. ``GradientShares`` notes the gradient edge of every DTensor a body
receives (and of every parameter it owns) together with the span of autograd sequence numbers the
nodes made during that body get; at the end of the forward it walks the graph from the root's
outputs and puts a post-hook on every node that hands a gradient along a noted edge, which reports
the layout of that one contribution. After backward (``settle``):

* a body's share is the layout of the contributions its span's nodes made; contributions in two
  layouts would be added as local tensors by the static body, so it stays eager;
* a body input whose share meets other contributions to the same tensor in another layout stays
  with an eager caller: a static caller would add them as local tensors (DTensor, recording,
  reconciles them first). The op watcher leaves those sums of autograd's alone (``summing``: the
  node whose outputs autograd is adding to other gradients now), where it judged the alias's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["GradientShares", "SUMS"]

SUMS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)  # how autograd adds a tensor's gradients


@dataclass
class _Share:
    """One body's use of one tensor: the sequence numbers of the nodes its body made, ``[start,
    end)``, and what to tell of the layout its nodes hand back."""

    path: str
    what: str  # "input 0", "parameter 'weight'": for messages
    is_input: bool
    start: int
    on_share: Callable[[tuple], None]
    end: int | None = None  # None while the body runs


@dataclass
class _Edge:
    """A noted gradient edge: its node (kept alive: edges are matched by the node's id), the bodies
    that use the tensor, and every contribution autograd hands along it: (node's sequence number,
    placements on mesh dims of more than one rank)."""

    node: object
    shares: list = field(default_factory=list)
    contributions: list = field(default_factory=list)


def _layout(g: DTensor) -> tuple:
    """The gradient's placements where they matter: a mesh dim of one rank holds the same local
    tensor whatever its placement says."""
    mesh = g.device_mesh
    return tuple(p if mesh.size(i) > 1 else Replicate() for i, p in enumerate(g.placements))


class GradientShares:
    """The bodies' gradient shares of one recording step (see the module's docstring)."""

    def __init__(self):
        self.edges: dict[tuple[int, int], _Edge] = {}
        # (node, its contributions along noted edges) while autograd adds those to the tensors'
        # other gradients (see the module's docstring)
        self.summing: tuple | None = None

    def expect(self, t: torch.Tensor, path: str, what: str, is_input: bool, on_share: Callable[[tuple], None]) -> _Share:
        """Note that the body of ``path`` starting now uses ``t``; ``on_share(placements)`` is
        called after backward with the layout of the gradient the body hands back for it. The
        caller ends the body's span with ``end`` on what this returns."""
        edge = get_gradient_edge(t)
        key = (id(edge.node), edge.output_nr)
        noted = self.edges.get(key)
        if noted is None or noted.node is not edge.node:
            noted = self.edges[key] = _Edge(edge.node)
        share = _Share(path, what, is_input, torch._C._autograd._get_sequence_nr(), on_share)
        noted.shares.append(share)
        return share

    @staticmethod
    def end(shares: list) -> None:
        """The bodies of ``shares`` are over: later nodes are not theirs."""
        now = torch._C._autograd._get_sequence_nr()
        for share in shares:
            share.end = now

    def hook(self, outputs: list) -> None:
        """End of the recording forward: hook every node that hands a gradient along a noted edge
        (found from ``outputs``, the root's output tensors)."""
        if not self.edges:
            return
        seen: dict[int, object] = {}  # id -> node, kept alive while ids are compared
        todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            taps = []
            for i, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                noted = self.edges.get((id(nxt), nr))
                if noted is not None and noted.node is nxt:
                    taps.append((i, noted))
                if id(nxt) not in seen:
                    todo.append(nxt)
            if taps:
                node.register_hook(self._tap(node, node._sequence_nr(), taps))

    def _tap(self, node, seq: int, taps: list):
        def post(grad_inputs: tuple, grad_outputs: tuple) -> None:
            handed = []
            for i, noted in taps:
                g = grad_inputs[i]
                if isinstance(g, DTensor):
                    noted.contributions.append((seq, _layout(g), tuple(g.placements)))
                    handed.append(g)
            self.summing = (node, handed)  # autograd adds these to the tensors' other gradients next
            return None

        return post

    def sums(self, node: torch.autograd.graph.Node, func: Callable[..., Any], args: tuple) -> bool:
        """Whether ``func`` (run while ``node`` is autograd's current node) is autograd adding a
        contribution along a noted edge to the tensor's other gradients."""
        summing = self.summing
        if summing is None or summing[0] is not node or func not in SUMS:
            return False
        return any(a is g for a in args[:2] for g in summing[1])

    def settle(self, parent: dict) -> tuple[dict[str, str], dict[str, str]]:
        """After backward: tell every body its share's layout. Returns the modules that must stay
        eager (path -> why): the bodies whose own contributions come in two layouts, and the callers
        that would add a body's share to a contribution of another layout as local tensors (the
        latter show only while those callers are assumed static: the runtime keeps them)."""
        unsafe: dict[str, str] = {}
        callers: dict[str, str] = {}
        for noted in self.edges.values():
            for share in noted.shares:
                end = share.end if share.end is not None else float("inf")
                mine = [(layout, placements) for seq, layout, placements in noted.contributions if share.start <= seq < end]
                if not mine:
                    continue  # no gradient reached the body's uses
                layouts = {layout for layout, _ in mine}
                if len(layouts) > 1:
                    unsafe.setdefault(share.path, (
                        f"in backward, its own ops hand back gradients of its {share.what} as "
                        f"{' and '.join(str(list(p)) for p in sorted({p for _, p in mine}, key=str))}, which its "
                        f"local tensors cannot add"))
                    continue
                share.on_share(mine[0][1])
                if not share.is_input or parent.get(share.path) is None:
                    continue
                others = {placements for seq, layout, placements in noted.contributions
                          if not share.start <= seq < end and layout not in layouts}
                if others:
                    callers.setdefault(parent[share.path], (
                        f"in backward, gradients of one tensor arrive from its consumers as "
                        f"{list(mine[0][1])} (from {share.path!r}) and "
                        f"{' and '.join(str(list(p)) for p in sorted(others, key=str))}, which its local tensors cannot add"))
        return unsafe, callers
