"""The prompt's logprobs (vLLM's prompt_logprobs): each prompt token's raw log-probability given the tokens before it,
its rank, and the most likely ids, taken in the pass that folds it."""

from __future__ import annotations

import torch

from kernels.host import HostCopy, to_device
from rankwire.header import LaneRows
from server.engine import PromptLogprob


class PromptRound:
    """One round's prompt logprobs on their way to the host, lane by lane: (plan row index, how many most likely ids,
    the (position, token) of each entry) and their host copies."""

    def __init__(self) -> None:
        self.lanes: list[tuple[int, int, list[tuple[int, int]], list[HostCopy]]] = []

    def add(self, index: int, most: int, logprobs: torch.Tensor, targets: list[tuple[int, int]]) -> None:
        """A lane's rows (log-softmax, fp32) and the token each gives the logprob of, reduced to what the host reads
        at once, so no lane's rows outlive the call."""
        from server.runner import most_likely  # the runner imports this module

        at = to_device(logprobs.device, [token for _, token in targets], torch.long)
        chosen = logprobs.gather(1, at[:, None])
        rank = (logprobs >= chosen).sum(dim=1)  # vLLM's rank: how many ids are at least as likely
        copies = [HostCopy(chosen[:, 0]), HostCopy(rank)]
        if most:
            top = most_likely(logprobs, most)
            copies += [HostCopy(top), HostCopy(logprobs.gather(1, top))]
        self.lanes.append((index, most, targets, copies))

    def by_row(self) -> dict[int, tuple[PromptLogprob, ...]]:
        """Each plan row's prompt logprobs, in position order."""
        out = {}
        for index, most, targets, copies in self.lanes:
            chosen, ranks, *top = (copy.tolist() for copy in copies)
            ids, values = top if most else ([[]] * len(targets), [[]] * len(targets))
            out[index] = tuple(
                PromptLogprob(token, chosen[at], ranks[at], tuple(zip(ids[at], values[at], strict=True)))
                for at, (_, token) in enumerate(targets)
            )
        return out


class PromptLogprobs:
    """The lanes' prompt passes that asked for the prompt's logprobs: a pass's rows give the logprobs of its own next
    tokens; its last row's log-softmax waits on the device for the next pass's first token."""

    def __init__(self) -> None:
        self.pending: dict[int, torch.Tensor] = {}  # by slot: the last pass's last row, its token not seen yet

    def drop(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def launch(
        self, plan_rows: tuple[LaneRows, ...], places: list[tuple[int, int]], logits: torch.Tensor
    ) -> PromptRound | None:
        """The round's prompt logprobs from its logits (None: no token's is known yet): `places` holds (plan row
        index, its first logit row) of each row that asked, whose every token row has logits."""
        taken = PromptRound()
        for index, first in places:
            lane = plan_rows[index]
            tokens, start = lane.token_ids, lane.start
            logprobs = torch.log_softmax(logits[first : first + len(tokens)].float(), dim=-1)
            rows, targets = logprobs[:-1], [(start + i, token) for i, token in enumerate(tokens[1:], 1)]
            waiting = self.pending.pop(lane.slot, None)
            if waiting is not None:  # the last pass's last row: its token is this pass's first
                rows, targets = torch.cat((waiting[None], rows)), [(start, tokens[0]), *targets]
            if lane.draw is None:  # the prompt goes on in a later pass; a pass with a draw ends it
                self.pending[lane.slot] = logprobs[-1].clone()  # not a view holding the whole pass's rows
            if targets:
                taken.add(index, min(lane.prompt_logprobs, logprobs.shape[-1]), rows, targets)
        return taken if taken.lanes else None
