"""What the timing fits learn from (``kvmesh.router.core.observations.Observations``), driven as the
router drives it: a request counted as load, then observed from dispatch to finish."""

from __future__ import annotations

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.router.core.conversations import Conversations
from kvmesh.router.core.copies import SharedPrefixes
from kvmesh.router.core.joins import Joins
from kvmesh.router.core.load import ActiveSequences, PromptBlocks
from kvmesh.router.core.observations import Observations
from kvmesh.router.core.pass_lag import PassLag
from kvmesh.router.core.route_types import RouteRequest, TimingSample
from kvmesh.router.core.router_state import RouterState, WorkerLimits
from kvmesh.router.core.stays import Stays
from kvmesh.router.core.tail import TtftTail
from kvmesh.router.core.timing import MOCKER_PRIOR, TimingModel, WorkerTiming
from kvmesh.router.core.wait_spread import WaitSpread

W = ("w", 0)
BS = 16


class Fleet:
    """One worker's load, timing model and the observations over them."""

    def __init__(self, total_blocks: int = 10_000) -> None:
        self.load = ActiveSequences(block_size=BS)
        self.load.add_worker(W)
        self.timing = {
            W: WorkerTiming(TimingModel(MOCKER_PRIOR, 8192), TimingModel(MOCKER_PRIOR, 8192), False)
        }
        self.joins = Joins()
        self.stays = Stays()
        self.spread = WaitSpread()
        workers = {"w": WorkerLimits(1, total_blocks, 8192, BS)}
        state = RouterState(
            self.load,
            self.timing,
            workers,
            Conversations(),
            self.joins,
            self.spread,
            SharedPrefixes(),
            self.stays,
            TtftTail(),
            PassLag(),
        )
        self.obs = Observations(state)

    def send(self, rid: str, tokens: int, now: float, *, expected_prefill: float = 0.05) -> None:
        """Route ``rid`` (``tokens`` uncached) here at ``now``, as ``KvRouter._finish`` does."""
        ids = [ord(rid) * 100_000 + i for i in range(tokens)]  # a prompt of its own
        hashes = block_hashes(ids, BS)
        view = self.load.step_in_progress(W, now)  # before it joins the queue
        self.load.add(rid, W, PromptBlocks(hashes), tokens, 0, now, expected_prefill=expected_prefill)
        self.obs.start(RouteRequest(rid, hashes, tokens), W, 0, None, now, view)

    def first_token(self, rid: str, now: float, timed: bool = True) -> None:
        self.obs.first_token(rid, now, timed)
        self.load.prefill_done(rid, now)

    def finish(self, rid: str, now: float) -> TimingSample | None:
        self.load.free(rid, now)
        return self.obs.finish(rid, now)


@pytest.mark.parametrize(
    ("tokens", "first_token_at", "joined"),
    [
        pytest.param(64, 0.0605, 1.0, id="first-token-with-the-step-s-request-joined-it"),
        pytest.param(2048, 0.160, 0.0, id="first-token-a-step-later-waited-it-out"),
    ],
)
def test_a_request_routed_behind_a_step_in_progress_is_learned_to_have_joined_it_or_not(
    tokens: int, first_token_at: float, joined: float
) -> None:
    f = Fleet()
    f.send("a", 2048, 0.0)
    f.send("b", tokens, 0.002)  # 2 ms later, while a's step is predicted to run
    f.first_token("a", 0.060)
    f.first_token("b", first_token_at)
    share = f.joins.describe()
    assert sum(share["seen"]) == 1 and max(share["joined_share"]) == joined


def test_a_finished_request_teaches_its_worker_s_fit_and_stay_and_reports_the_prediction() -> None:
    f = Fleet()
    f.send("a", 1024, 0.0)
    f.first_token("a", 0.080)
    f.obs.reported_cached("a", 0)
    sample = f.finish("a", 0.580)
    assert sample is not None and sample.worker == W
    assert sample.observed_s == pytest.approx(0.080) and sample.predicted_s > 0
    assert f.timing[W].own.observations == 1
    assert f.stays.decode_s[W] == pytest.approx(0.5) and f.stays.in_system_s[W] == pytest.approx(0.58)
    assert f.stays.reuse_fleet == 0.0  # nothing of its prompt was cached


def test_an_answer_that_came_whole_teaches_no_timing() -> None:
    f = Fleet()
    f.send("a", 1024, 0.0)
    f.first_token("a", 0.500, timed=False)  # a non-streamed answer: its "first token" is the end
    assert f.finish("a", 0.500) is None
    assert f.timing[W].own.observations == 0 and W not in f.stays.decode_s


def test_a_request_that_joined_a_step_teaches_no_curve_the_step_s_own_request_does() -> None:
    f = Fleet()
    f.send("a", 2048, 0.0)
    f.send("b", 64, 0.002)
    f.first_token("a", 0.060)
    f.first_token("b", 0.0605)
    f.finish("b", 0.3)
    assert f.timing[W].own.observations == 0
    f.finish("a", 0.3)
    assert f.timing[W].own.observations == 1


def test_a_request_sent_past_the_cache_is_counted_apart_and_not_fitted() -> None:
    f = Fleet(total_blocks=64)  # a 2048-token prompt is 128 blocks: past this worker's cache
    f.send("a", 2048, 0.0)
    f.first_token("a", 0.9)
    f.finish("a", 1.2)
    assert f.timing[W].waited_for_memory == 1 and f.timing[W].own.observations == 0


def test_a_dropped_request_teaches_nothing() -> None:
    f = Fleet()
    f.send("a", 1024, 0.0)
    f.first_token("a", 0.080)
    f.obs.drop("a")
    assert f.finish("a", 0.5) is None and f.timing[W].own.observations == 0
