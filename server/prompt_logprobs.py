"""The prompt's logprobs (vLLM's prompt_logprobs): each prompt token's raw log-probability given the tokens before it,
its rank, and the most likely ids, taken in the pass that folds it."""

from __future__ import annotations

import torch

from kernels.host import HostCopy, to_device
from rankwire.header import LaneRows
from server.engine import PromptLogprob

MOST_LIKELY = 20  # the most likely ids taken with each prompt token (the API's largest prompt_logprobs)


class PromptRound:
    """One round's prompt logprobs on their way to the host: by plan row index, the (position, token) of each."""

    def __init__(self, logprobs: torch.Tensor, targets: list[tuple[int, int, int]]) -> None:
        from server.runner import most_likely  # the runner imports this module

        self.targets = targets  # (plan row index, position, token), in the rows' order
        at = to_device(logprobs.device, [token for _, _, token in targets], torch.long)
        chosen = logprobs.gather(1, at[:, None])
        top = most_likely(logprobs, min(MOST_LIKELY, logprobs.shape[-1]))
        self.copies = [
            HostCopy(chosen[:, 0]),
            HostCopy((logprobs > chosen).sum(dim=1) + 1),  # vLLM's rank: 1 + how many ids are likelier
            HostCopy(top),
            HostCopy(logprobs.gather(1, top)),
        ]

    def by_row(self) -> dict[int, tuple[PromptLogprob, ...]]:
        """Each plan row's prompt logprobs, in position order."""
        chosen, ranks, ids, values = (copy.tolist() for copy in self.copies)
        out: dict[int, list[PromptLogprob]] = {}
        for at, (index, _, token) in enumerate(self.targets):
            top = tuple(zip(ids[at], values[at], strict=True))
            out.setdefault(index, []).append(PromptLogprob(token, chosen[at], ranks[at], top))
        return {index: tuple(entries) for index, entries in out.items()}


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
        rows, targets = [], []
        for index, first in places:
            lane = plan_rows[index]
            tokens, start = lane.token_ids, lane.start
            logprobs = torch.log_softmax(logits[first : first + len(tokens)].float(), dim=-1)
            waiting = self.pending.pop(lane.slot, None)
            if waiting is not None:  # the last pass's last row: its token is this pass's first
                rows.append(waiting[None])
                targets.append((index, start, tokens[0]))
            rows.append(logprobs[:-1])
            targets += [(index, start + i, token) for i, token in enumerate(tokens[1:], 1)]
            if lane.draw is None:  # the prompt goes on in a later pass; a pass with a draw ends it
                self.pending[lane.slot] = logprobs[-1].clone()  # not a view holding the whole pass's rows
        return PromptRound(torch.cat(rows), targets) if targets else None
