"""The decode step as a task graph: a data structure built once per batch shape, bound by executors.

Per layer l (place: where the node runs):
    L{l}.transfer        device  starts copying layer l's first cpu_transfer chunk into ping-pong buffer
                                 l % 2 without waiting: it is placed right after layer l-1's device
                                 partial, so the copy runs while layer l-1 merges and runs its MoE
    L{l}.qkv             device  norm, projections, rope (MLA: absorbed query); the token's KV to store
    L{l}.window_write    device  the new token's KV into the GPU window
    L{l}.cpu_partial     cpu     partial attention over the batch's cpu_compute tokens (C++ kernel)
    L{l}.device_partial  device  partial attention over the window and the ping-pong chunks
    L{l}.merge           device  exact LSE merge of the partials
    L{l}.out_proj        device  output projection and residual
    L{l}.ffn             device  dense MLP or MoE, residual
then `logits` and `commit` (the step's tokens are final; full windows flush). cpu_partial depends
only on qkv, so an executor can run it while the device writes the window and attends its part.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_OPS = ("transfer", "qkv", "window_write", "cpu_partial", "device_partial", "merge", "out_proj", "ffn")


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    layer: int | None
    place: str  # "device" or "cpu"
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class DecodeGraph:
    num_layers: int
    nodes: tuple[Node, ...]  # in a topological order

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def layer_nodes(self, layer: int) -> list[Node]:
        return [n for n in self.nodes if n.layer == layer]


def build_decode_graph(num_layers: int) -> DecodeGraph:
    """The same for every batch size: the batch lives in the step's tensors, not in the graph."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    nodes = [Node("embed", "embed", None, "device", ()), Node("L0.transfer", "transfer", 0, "device", ("embed",))]
    hidden = "embed"
    for layer in range(num_layers):
        p = f"L{layer}."
        nodes += [
            Node(p + "qkv", "qkv", layer, "device", (hidden,)),
            Node(p + "window_write", "window_write", layer, "device", (p + "qkv",)),
            Node(p + "cpu_partial", "cpu_partial", layer, "cpu", (p + "qkv",)),
            Node(p + "device_partial", "device_partial", layer, "device",
                 (p + "qkv", p + "window_write", p + "transfer")),
        ]
        if layer + 1 < num_layers:  # the next layer's copy starts as soon as this layer's buffer use ends
            nodes.append(Node(f"L{layer + 1}.transfer", "transfer", layer + 1, "device", (p + "device_partial",)))
        nodes += [
            Node(p + "merge", "merge", layer, "device", (p + "cpu_partial", p + "device_partial")),
            Node(p + "out_proj", "out_proj", layer, "device", (p + "merge", hidden)),
            Node(p + "ffn", "ffn", layer, "device", (p + "out_proj",)),
        ]
        hidden = p + "ffn"
    nodes += [Node("logits", "logits", None, "device", (hidden,)),
              Node("commit", "commit", None, "device", ("logits",))]
    return DecodeGraph(num_layers, tuple(nodes))
