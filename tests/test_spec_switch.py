"""The automatic speculation switch (worker/spec/switch.py): its decision on given step costs, the running
tau, probing while paused, and in the engine: a switch that says "no" at the batch size makes the step plain
(no drafts, the same tokens), one that says "yes" speculates; the start-up measurement on CPU."""

from __future__ import annotations

import pytest
from test_async_scheduling import make_engine, results, run
from test_spec import NGRAM, repetitive

from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import SchedulerConfig, SpeculativeConfig
from tokenmill.worker.spec.switch import SpeculationSwitch, StepCosts

# A memory-bound step at small batches turning compute-bound: decode costs 10 ms up to batch 8, then grows
# linearly; verifying k=3 drafts (4 tokens a request) costs little more at batch 1, 4x decode at batch 128.
COSTS = StepCosts(batch_sizes=(1, 8, 32, 128), decode_s=(0.010, 0.010, 0.016, 0.040),
                  verify_s=(0.011, 0.014, 0.045, 0.160), draft_s=(0.002, 0.002, 0.004, 0.010), k=3)


def test_interpolation_between_and_beyond_the_measured_sizes() -> None:
    assert COSTS.at(COSTS.decode_s, 1) == COSTS.at(COSTS.decode_s, 0) == 0.010
    assert COSTS.at(COSTS.decode_s, 20) == pytest.approx(0.013)
    assert COSTS.at(COSTS.verify_s, 32) == pytest.approx(0.045)
    assert COSTS.at(COSTS.decode_s, 224) == pytest.approx(0.064), "linear through the last two"
    single = StepCosts((4,), (0.01,), (0.02,), (0.0,), 2)
    assert single.at(single.verify_s, 100) == 0.02


def test_speculation_pays_at_small_batches_and_not_at_large_ones() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=2.5)
    # batch 1: 2.5 x 10 ms > 11 + 2 ms; batch 32: 2.5 x 16 = 40 ms < 45 + 4 ms; batch 128: 100 < 170.
    assert switch.pays(1) and switch.pays(8)
    assert not switch.pays(32) and not switch.pays(128)
    edge = switch.breakeven_batch(128)
    assert edge is not None and 8 < edge <= 32
    assert switch.pays(edge - 1) and not switch.pays(edge)
    # A better tau moves the break-even point up; tau 1 (nothing accepted) never pays.
    assert SpeculationSwitch(COSTS, prior_tau=4.0).pays(32)
    assert SpeculationSwitch(COSTS, prior_tau=1.0).breakeven_batch(128) == 1
    # A margin asks for that much more than break-even.
    assert not SpeculationSwitch(COSTS, prior_tau=2.5, margin=2.0).pays(1)


def test_tau_follows_the_verify_steps_and_a_paused_switch_probes() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=2.5, smoothing=0.5, probe_every=4)
    switch.record(4, 0)  # four requests verified, nothing accepted: tau -> 1
    assert switch.tau == pytest.approx(1.75)
    switch.record(0, 0)
    assert switch.tau == pytest.approx(1.75), "a step without verification changes nothing"
    for _ in range(6):
        switch.record(2, 0)
    assert switch.tau < 1.05 and not switch.pays(1)
    decisions = [switch.should_speculate(1) for _ in range(188)]
    probes = [i + 1 for i, d in enumerate(decisions) if d]
    assert probes == [4, 12, 28, 60, 124, 188], "the first probe after 4 paused steps, each next one twice as " \
        "late, up to 16 x 4"
    for _ in range(10):
        switch.record(1, 3)  # the probes accept everything: tau -> 4
    assert switch.should_speculate(32) and switch.probe_wait == 4, "speculating again resets the wait"
    switch.tau = 1.0
    assert [switch.should_speculate(1) for _ in range(4)] == [False, False, False, True]


def test_tau_starts_as_a_running_mean_of_the_prior_and_the_steps_seen() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=3.0, smoothing=0.1)
    for n in range(1, 10):
        switch.record(1, 0)  # nothing accepted: each step's tau is 1
        assert switch.tau == pytest.approx((3.0 + n) / (n + 1)), "the mean of the prior and n steps"
    before = switch.tau
    switch.record(1, 0)  # the 10th step: weight 1 / 11 < smoothing, from now on the exponential average
    assert switch.tau == pytest.approx(before + 0.1 * (1.0 - before))


def test_the_probes_back_off_only_while_they_leave_speculation_paused() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=1.0, probe_every=2, max_probe_every=5)
    assert [switch.should_speculate(1) for _ in range(2 + 4 + 5 + 5)].count(True) == 4
    assert switch.probe_wait == 5
    with pytest.raises(ValueError):
        SpeculationSwitch(COSTS, probe_every=8, max_probe_every=4)


def test_a_paused_switch_keeps_features_only_before_its_probes() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=1.0, probe_every=10, feature_window=3)
    assert not switch.pays(1)
    steps = [(switch.should_speculate(1), switch.keeps_features()) for _ in range(30)]
    # paused steps 1..6 keep nothing, 7..9 keep (the probe's catch-up reads them), the 10th probes and keeps;
    # the next probe comes 20 paused steps later, the 3 before it keeping
    assert steps == ([(False, False)] * 6 + [(False, True)] * 3 + [(True, True)]
                     + [(False, False)] * 16 + [(False, True)] * 3 + [(True, True)])
    paying = SpeculationSwitch(COSTS, prior_tau=2.5)
    assert all(paying.should_speculate(1) and paying.keeps_features() for _ in range(5))
    with pytest.raises(ValueError):
        SpeculationSwitch(COSTS, probe_every=4, feature_window=5)


def test_live_steps_correct_the_start_up_costs_per_batch_bucket() -> None:
    switch = SpeculationSwitch(COSTS, prior_tau=2.5, smoothing=0.5)
    assert switch.pays(1) and switch.pays(8)
    # Live speculating steps at batch 1 cost 3x the modelled 13 ms: 2.5 x 10 < 39 ms, no longer paying there;
    # batch 8 (another bucket) keeps its start-up costs.
    switch.observe_step(1, True, 0.039)
    assert not switch.pays(1) and switch.pays(8)
    # Plain steps at batch 1 cost 2x their model as well: 2.5 x 20 = 50 > 39 ms, paying again.
    switch.observe_step(1, False, 0.020)
    assert switch.pays(1)
    # The factor is a running mean, then an exponential average with weight `smoothing`.
    switch.observe_step(1, False, 0.010)
    assert switch.pays(1) is (2.5 * 0.010 * 1.5 > 0.039)
    switch.observe_step(1, False, -1.0)  # nonsense is ignored
    switch.observe_step(0, False, 0.010)
    assert switch.pays(1) is (2.5 * 0.010 * 1.5 > 0.039)
    # 2 and 3 share a bucket; 4 begins the next.
    switch.observe_step(2, True, 10.0)
    assert not switch.pays(3) and switch.pays(4)


class RecordingSwitch(SpeculationSwitch):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.observed: list[tuple[int, bool, float]] = []
        self.verify_steps = self.timed_verify_steps = 0
        self._verified = False

    def record(self, verified: int, accepted: int) -> None:  # the engine records a step before it times it
        self.verify_steps += verified > 0
        self._verified = verified > 0
        super().record(verified, accepted)

    def observe_step(self, batch: int, speculated: bool, seconds: float) -> None:
        self.observed.append((batch, speculated, seconds))
        self.timed_verify_steps += self._verified
        self._verified = False
        super().observe_step(batch, speculated, seconds)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_times_its_decode_only_steps_for_the_switch(async_scheduling: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 2, seed=3))]
    engine = make_engine("tiny-llama", async_scheduling, speculative=NGRAM)
    engine.switch = switch = RecordingSwitch(COSTS, prior_tau=2.5, probe_every=10**6)
    run(engine, jobs)
    kinds = {speculated for _, speculated, _ in switch.observed}
    assert kinds == {True}, "every decode step speculates where it pays"
    assert switch.timed_verify_steps == switch.verify_steps > 0, "the steps that verified drafts are timed too"
    assert all(b in (1, 2) and s > 0 for b, _, s in switch.observed), "two requests, one may finish first"
    assert len(switch.observed) < 24, "prompt steps are not timed"
    engine = make_engine("tiny-llama", async_scheduling, speculative=NGRAM)
    engine.switch = switch = RecordingSwitch(COSTS, prior_tau=1.0, probe_every=10**6)
    run(engine, jobs)
    assert {speculated for _, speculated, _ in switch.observed} == {False}
    assert 20 <= len(switch.observed) <= 24, "each plain decode step is timed once it completes"


def test_the_engine_pauses_once_live_speculating_steps_cost_more_than_the_start_up_model_said() -> None:
    # Modelled: a 10 us plain step and a 1 us speculating one, so it pays at once even with a margin of 10; the
    # first live speculating step (about as long as a plain one on the CPU, a millisecond or so) corrects that,
    # and with probes off the rest of the run is plain (tau <= 5 at k = 4 cannot beat the margin of 10).
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 2, seed=3))]
    plain = results(run(make_engine("tiny-llama", False), jobs))
    engine = make_engine("tiny-llama", False, speculative=NGRAM)
    engine.switch = switch = RecordingSwitch(StepCosts((1,), (1e-5,), (1e-6,), (0.0,), 4), prior_tau=2.0,
                                             margin=10.0, probe_every=10**6)
    assert switch.pays(2)
    assert results(run(engine, jobs)) == plain
    kinds = [speculated for _, speculated, _ in switch.observed]
    assert kinds[0] and sum(kinds) <= 2, "speculating stops after the first timed step of each bucket"
    assert not switch.pays(2)
    assert engine.counters.draft_tokens <= 2 * 2 * 4, "at most one speculating step per bucket (batch 1, 2)"


@pytest.mark.parametrize("kw", [dict(batch_sizes=(8, 1)), dict(batch_sizes=(0, 2)), dict(decode_s=(0.0, 1.0)),
                                dict(draft_s=(0.1,))])
def test_bad_costs_are_refused(kw: dict[str, tuple[float, ...]]) -> None:
    base = dict(batch_sizes=(1, 2), decode_s=(0.01, 0.01), verify_s=(0.02, 0.02), draft_s=(0.0, 0.0))
    with pytest.raises(ValueError):
        StepCosts(k=2, **(base | kw))  # type: ignore[arg-type]


def test_the_engine_speculates_only_where_the_switch_says_it_pays() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 4, seed=7))]
    plain = results(run(make_engine("tiny-llama", False), jobs))
    for batch_limit, drafts in ((2, False), (8, True)):
        engine = make_engine("tiny-llama", False, speculative=NGRAM)
        # Costs under which speculation pays below `batch_limit` requests and never at or above it.
        engine.switch = SpeculationSwitch(
            StepCosts((batch_limit - 1, batch_limit), (0.01, 0.01), (0.011, 1.0), (0.0, 0.0), 4),
            prior_tau=2.0, probe_every=10**6)
        assert results(run(engine, jobs)) == plain
        # Four requests run together from start to end: no drafts at limit 2, drafts at limit 8.
        assert (engine.counters.draft_tokens > 0) is drafts


def test_the_start_up_measurement_on_cpu() -> None:
    engine = make_engine("tiny-llama", False, speculative=SpeculativeConfig(method="ngram", auto_switch=True),
                         scheduler=SchedulerConfig(max_num_seqs=8))
    switch = engine.switch
    assert switch is not None
    assert switch.costs.batch_sizes == (1, 8) and switch.costs.k == 3
    assert all(t > 0 for t in switch.costs.decode_s + switch.costs.verify_s)
    assert switch.costs.draft_s == (0.0, 0.0), "prompt lookup costs no device time"
    assert make_engine("tiny-llama", False, speculative=NGRAM).switch is None, "auto: off on CPU"
