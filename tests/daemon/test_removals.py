"""``RemovalLog`` against a reference that remembers every removal: for each writer out, what
it asks (``removed_since``) is what the full history says, and the log keeps only removals a
writer out predates."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached.cache.removals import RemovalLog

KEYS = [bytes([i]) for i in range(6)]


class RemovalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.log = RemovalLog()
        self.history: list[tuple[int, frozenset[bytes] | None]] = []  # (seq, keys | clear)
        self.out: list[int] = []  # epochs of the writers out

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def remove(self, keys: list[bytes]) -> None:
        self.log.record(keys)
        self.history.append((self.log.seq, frozenset(keys)))

    @rule()
    def clear(self) -> None:
        self.log.record(None)
        self.history.append((self.log.seq, None))

    @rule()
    def lend(self) -> None:
        self.out.append(self.log.lend())

    @precondition(lambda self: self.out)
    @rule(i=st.integers(min_value=0))
    def give_back(self, i: int) -> None:
        self.log.end_lend(self.out.pop(i % len(self.out)))

    @invariant()
    def each_writer_out_sees_every_removal_after_its_epoch(self) -> None:
        for epoch in self.out:
            for k in KEYS:
                truth = any(seq > epoch and (keys is None or k in keys)
                            for seq, keys in self.history)
                assert self.log.removed_since(k, epoch) == truth, (k, epoch)

    @invariant()
    def only_removals_a_writer_out_predates_are_kept(self) -> None:
        assert self.log.lent == len(self.out)
        if not self.out:
            assert self.log.kept == 0
            return
        first = min(self.out)
        after = set().union(*(keys for seq, keys in self.history
                              if seq > first and keys is not None))
        assert self.log.kept <= len(after)


TestRemovalMachine = RemovalMachine.TestCase
