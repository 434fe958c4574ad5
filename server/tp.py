"""The two-rank glue: rank 0's runner sends each plan over the control link first; rank 1 follows the plans."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from rankwire.codec import HeaderError
from rankwire.errors import FrameError, LinkError, PeerFailed, PeerGone
from rankwire.header import RoundKind, RoundPlan
from rankwire.link import ControlLink
from server.round_trace import RoundTrace
from server.runner import LaneResult, LaunchedRound, ModelRunner

log = logging.getLogger(__name__)


class LinkedRunner:
    """Rank 0's runner: every plan goes to rank 1 before this rank runs it, so both enter the same collectives."""

    def __init__(self, runner: ModelRunner, link: ControlLink, timeout_s: float) -> None:
        self.runner, self.link = runner, link
        self.lock = threading.Lock()  # held from a round's header to its verdict: no STOP goes out between them
        runner.agreement = lambda problem: link.exchange_verdicts(problem, timeout_s)

    @property
    def max_lanes(self) -> int:
        return self.runner.max_lanes

    @property
    def can_draft(self) -> bool:
        return self.runner.can_draft

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def prompt_align(self) -> int:
        return self.runner.prompt_align

    @property
    def trace(self) -> RoundTrace:
        return self.runner.trace

    @property
    def linked(self) -> bool:
        return True

    def kept_bytes(self, handle: int) -> int:
        return self.runner.kept_bytes(handle)

    def launch(self, plan: RoundPlan, launched: Callable[[], None] | None = None) -> LaunchedRound:
        """Send the plan to rank 1, then launch it here (the link held until then: `close` waits for the verdict)."""
        with self.lock:
            self.link.send_header(plan)
            self.runner.trace.mark("link")
            return self.runner.launch(plan, launched)

    def finish(
        self, launched: LaunchedRound, tokens_known: Callable[[list[LaneResult]], None] | None = None
    ) -> list[LaneResult]:
        return self.runner.finish(launched, tokens_known)

    def close(self) -> None:
        """Tell rank 1 to stop, if it is still there."""
        with contextlib.suppress(OSError, LinkError), self.lock:
            self.link.send_header(RoundPlan(kind=RoundKind.STOP))
        self.link.close()


def watch_peer(link: ControlLink, on_gone: Callable[[str], None], stop: threading.Event, every_s: float = 0.2) -> None:
    """Rank 0: notice a rank 1 that died or reported a failure between rounds, and say so once."""
    while not stop.wait(every_s):
        if link.watch_for_hangup():
            on_gone("rank 1 hung up or failed")
            return


def follow(link: ControlLink, runner: ModelRunner, timeout_s: float) -> int:
    """Rank 1: run every plan rank 0 sends until STOP (exit 0) or rank 0 goes away (exit 1); its verdict on each
    goes to rank 0 before rank 0's is awaited (within `timeout_s`). A round that may be (`ahead_safe`) is finished
    once the next one is launched, as rank 0 does when it plans ahead, so this rank's GPU is never left waiting on
    its host between such rounds."""
    trace = runner.trace
    runner.agreement = lambda problem: link.exchange_verdicts(problem, timeout_s)
    runner.takes_logprobs = False  # rank 0 delivers the tokens, with their logprobs
    unfinished: LaunchedRound | None = None
    while True:
        trace.start()
        try:
            plan = link.recv_header()
        except PeerGone:
            log.error("rank 0 went away: exiting")
            return 1
        except PeerFailed as exc:
            log.error("rank 0 failed: %s", exc.message)
            return 1
        except (FrameError, HeaderError) as exc:  # rank 0 learns why, not only that this rank hung up
            log.error("rank 1 cannot read rank 0's round header: %s", exc)
            with contextlib.suppress(OSError):
                link.send_error(f"rank 1 cannot read rank 0's round header: {exc}")
            return 1
        trace.mark("wait")
        try:
            if plan.kind is RoundKind.STOP:
                if unfinished is not None:
                    runner.finish(unfinished)
                log.info("rank 0 asked to stop")
                return 0
            launched = runner.launch(plan)
            if unfinished is not None:
                runner.finish(unfinished)
            unfinished = launched if launched.ahead_safe and plan.rows else None
            if unfinished is None:
                runner.finish(launched)
            trace.write()
        except Exception as exc:
            log.exception("round failed on rank 1")
            with contextlib.suppress(OSError):
                link.send_error(f"rank 1: {exc}")
            return 1
