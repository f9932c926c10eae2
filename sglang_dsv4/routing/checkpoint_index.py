"""What the router knows one attention-DP rank holds: the checkpoints the rank reported making and not
yet dropping (:mod:`.rank_reports`), in a token-id radix trie bounded in tokens (least recently used go
first).

Each checkpoint ends a trie node (an edge is split where one lands), so the longest prefix of a
prompt that ends at a checkpoint is the deepest checkpoint node the prompt's walk passes whole
(:meth:`CheckpointIndex.longest_checkpointed_prefix`). A dropped checkpoint unmarks its node
(:meth:`CheckpointIndex.drop`). The trie holds at most ``max_tokens`` edge tokens: past that, the least
recently inserted or matched checkpoints are dropped, and with them the edges no checkpoint lies below.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "edge", "is_checkpoint", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.is_checkpoint = False


class CheckpointIndex:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0  # edge tokens held
        self._root = _Node((), None)
        self._recent: OrderedDict[_Node, None] = OrderedDict()  # checkpoint nodes, least recently used first

    def __len__(self) -> int:
        return len(self._recent)

    def insert(self, tokens: Sequence[int], positions: Sequence[int]) -> list[_Node]:
        """Checkpoints at ``positions`` (ascending, each in ``1 .. len(tokens)``) along ``tokens``: their
        nodes, for :meth:`drop` (one the bound dropped at once is dropped already)."""
        node, depth, nodes = self._root, 0, []
        for position in positions:
            node = self._extend(node, tokens[depth:position])
            depth = position
            node.is_checkpoint = True
            self._recent[node] = None
            self._recent.move_to_end(node)
            nodes.append(node)
        self._evict()
        return nodes

    def drop(self, node: _Node) -> None:
        """The checkpoint at ``node`` is gone (a no-op when the bound dropped it first)."""
        if self._recent.pop(node, False) is None:
            self._unmark(node)

    def longest_checkpointed_prefix(self, tokens: Sequence[int]) -> int:
        """Tokens in the longest prefix of ``tokens`` that ends at a checkpoint (0: none); marks it used."""
        node, depth, found, best = self._root, 0, 0, None
        while depth < len(tokens) and (child := node.children.get(tokens[depth])) is not None:
            edge = child.edge
            if tuple(tokens[depth : depth + len(edge)]) != edge:
                break
            node, depth = child, depth + len(edge)
            if node.is_checkpoint:
                found, best = depth, node
        if best is not None:
            self._recent.move_to_end(best)
        return found

    def _extend(self, node: _Node, tokens: Sequence[int]) -> _Node:
        """The node ending ``tokens`` below ``node``, splitting and adding edges as needed."""
        depth = 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = _Node(tuple(tokens[depth:]), node)
                node.children[child.edge[0]] = child
                self.tokens += len(child.edge)
                return child
            common = _common_length(child.edge, tokens[depth:])
            if common < len(child.edge):
                child = self._split(child, common)
            node, depth = child, depth + common
        return node

    def _split(self, node: _Node, length: int) -> _Node:
        """Cut ``node``'s edge after ``length`` tokens: the new upper node is returned."""
        upper = _Node(node.edge[:length], node.parent)
        node.parent.children[upper.edge[0]] = upper
        node.edge, node.parent = node.edge[length:], upper
        upper.children[node.edge[0]] = node
        return upper

    def _evict(self) -> None:
        while self.tokens > self.max_tokens and self._recent:
            node, _ = self._recent.popitem(last=False)
            self._unmark(node)

    def _unmark(self, node: _Node) -> None:
        """``node`` ends no checkpoint: it goes, and so do the edges above it no checkpoint lies below."""
        node.is_checkpoint = False
        while node is not self._root and not node.children and not node.is_checkpoint:
            del node.parent.children[node.edge[0]]
            self.tokens -= len(node.edge)
            node = node.parent


def _common_length(edge: tuple[int, ...], tokens: Sequence[int]) -> int:
    length = 0
    for a, b in zip(edge, tokens, strict=False):
        if a != b:
            break
        length += 1
    return length
