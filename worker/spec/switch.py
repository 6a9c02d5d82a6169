"""The automatic switch: speculate only while it pays.

With b requests decoding, a plain step yields b tokens in decode(b) seconds; a speculative step yields
b * tau tokens (tau: mean accepted drafts + 1 per request and verify step) in draft(b) + verify(b) seconds,
verify(b) being one target step of k+1 tokens per request. Speculation pays while
    tau * decode(b) > margin * (draft(b) + verify(b)).
At small b a step is bound by reading the weights, so verify(b) is close to decode(b) and any tau > 1
wins; at large b the step is bound by compute and verify(b) nears (k+1) x decode(b), so it loses. The costs
are measured at start-up at a few batch sizes (`measure_step_costs`) and interpolated linearly in b
(extrapolated from the last two beyond the largest); tau is a running average of the verify steps seen, from a
prior: the proposer's own expectation (an EAGLE head's held-out tau, recorded when it was trained) or 1 + k/2.
While speculation is paused, a probe step still speculates now and then, so tau keeps up with the workload (a
batch that shrinks back is seen at once: the decision is made every step). The first probe comes `probe_every`
steps into a pause; each probe that leaves it paused doubles the wait for the next, up to `max_probe_every`
(a workload the head drafts badly for pays a probe's extra cost ever more rarely), and speculating again resets
it. A paused step costs what a plain one does: the target's features (EAGLE's input) are kept only over the last
`feature_window` steps before a probe, so the probe's catch-up reads those and the head's KV holds what it held
for the positions before them (weaker drafts at a probe, so tau is, if anything, underestimated while paused: the
switch errs towards plain decoding).

The start-up costs are synthetic steps (one context length, the same blocks for every request, no host work around
them); a live step also drafts on the host, samples and verifies, and a speculating step runs synchronously while a
plain one overlaps the next launch. So the switch corrects them by what live decode-only steps cost
(`observe_step`): per power-of-two batch bucket and kind of step, a running factor live / modelled, applied in
`pays`. A bucket with no live step of a kind keeps the start-up cost for it."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.worker.model_runner import ModelRunner, attention_metadata


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at each batch size (ascending): a plain decode step, a target step verifying
    k drafts per request (k+1 tokens each), and drafting them (0 for prompt lookup)."""

    batch_sizes: tuple[int, ...]
    decode_s: tuple[float, ...]
    verify_s: tuple[float, ...]
    draft_s: tuple[float, ...]
    k: int

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        if n < 1 or not all(len(t) == n for t in (self.decode_s, self.verify_s, self.draft_s)):
            raise ValueError("one cost of each kind per batch size")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be ascending and >= 1, got {self.batch_sizes}")
        if min(self.decode_s) <= 0 or min(self.verify_s) <= 0 or min(self.draft_s) < 0:
            raise ValueError("step costs must be positive (drafting: >= 0)")

    def at(self, costs: Sequence[float], b: int) -> float:
        """`costs` (one of the three) at batch size b: linear between the measured sizes, the first below
        them, linear through the last two above them."""
        xs = self.batch_sizes
        if len(xs) == 1 or b <= xs[0]:
            return costs[0]
        i = min(bisect.bisect_left(xs, b), len(xs) - 1)  # xs[i-1] < b <= xs[i], or b past the last
        x0, x1, y0, y1 = xs[i - 1], xs[i], costs[i - 1], costs[i]
        return max(y0 + (y1 - y0) * (b - x0) / (x1 - x0), 0.0)


@dataclass
class _LiveCost:
    """The live decode-only steps of one kind at one batch bucket: their running live / modelled cost factor."""

    factor: float = 1.0
    steps: int = 0


class SpeculationSwitch:
    """Decides per step whether the running batch speculates (`should_speculate`) and learns tau from the
    verify steps (`record`)."""

    def __init__(self, costs: StepCosts, *, prior_tau: float | None = None, smoothing: float = 0.05,
                 margin: float = 1.0, probe_every: int = 50, max_probe_every: int | None = None,
                 feature_window: int | None = None) -> None:
        if feature_window is None:
            feature_window = min(8, probe_every)
        if max_probe_every is None:
            max_probe_every = 16 * probe_every
        if not (0 < smoothing <= 1 and margin > 0 and 1 <= probe_every <= max_probe_every
                and 1 <= feature_window <= probe_every):
            raise ValueError("need 0 < smoothing <= 1, margin > 0, 1 <= probe_every <= max_probe_every, "
                             "1 <= feature_window <= probe_every")
        self.costs = costs
        # Before any verify step: half the drafts accepted, a typical chat figure.
        self.tau = prior_tau if prior_tau is not None else 1.0 + costs.k / 2
        self.smoothing, self.margin = smoothing, margin
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.feature_window = feature_window
        self._paused_steps = 0  # steps since the last one that speculated
        self._wait = probe_every  # paused steps from the last speculating one to the next probe
        self._probed = False  # the last step that speculated was a probe
        self._recorded = 0  # verify steps recorded
        self._live: dict[tuple[bool, int], _LiveCost] = {}  # (speculated, batch.bit_length()) -> its live steps

    def pays(self, batch: int) -> bool:
        """Whether speculating at this batch size yields more tokens per second, at the current tau and the step
        costs corrected by the live steps seen at its bucket."""
        plain = self._modelled(False, batch) * self._factor(False, batch)
        spec = self._modelled(True, batch) * self._factor(True, batch)
        return self.tau * plain > self.margin * spec

    def _modelled(self, speculated: bool, batch: int) -> float:
        c = self.costs
        return c.at(c.verify_s, batch) + c.at(c.draft_s, batch) if speculated else c.at(c.decode_s, batch)

    def _factor(self, speculated: bool, batch: int) -> float:
        seen = self._live.get((speculated, batch.bit_length()))
        return 1.0 if seen is None else seen.factor

    def _weight(self, n: int) -> float:
        """The weight of the n-th value in a running mean that turns into an exponential average with weight
        `smoothing` from 1 / smoothing values on."""
        return max(self.smoothing, 1.0 / n)

    def observe_step(self, batch: int, speculated: bool, seconds: float) -> None:
        """A live decode-only step of `batch` requests took `seconds` from its decision to its outputs (plain:
        while the next one launched). Its factor over the modelled cost joins its bucket's running mean, an
        exponential average with weight `smoothing` from 1 / smoothing steps on."""
        if batch < 1 or seconds <= 0:
            return
        seen = self._live.setdefault((speculated, batch.bit_length()), _LiveCost())
        seen.steps += 1
        seen.factor += self._weight(seen.steps) * (seconds / self._modelled(speculated, batch) - seen.factor)

    def should_speculate(self, batch: int) -> bool:
        if self.pays(batch):
            self._paused_steps, self._probed, self._wait = 0, False, self.probe_every
            return True
        if self._probed:  # the probe just made left speculation paused: wait twice as long for the next
            self._wait, self._probed = min(2 * self._wait, self.max_probe_every), False
        self._paused_steps += 1
        if self._paused_steps >= self._wait:
            self._paused_steps, self._probed = 0, True
            return True
        return False

    @property
    def probe_wait(self) -> int:
        """Paused steps between the current pause's last speculating step and its next probe."""
        return self._wait

    def keeps_features(self) -> bool:
        """Whether the step just decided on (`should_speculate`) keeps the target's features for the drafts: a
        speculating step, or one of the last `feature_window` paused steps before a probe."""
        return self._paused_steps == 0 or self._paused_steps > self._wait - 1 - self.feature_window

    def record(self, verified: int, accepted: int) -> None:
        """A step verified drafts of `verified` requests, `accepted` drafts accepted in all. tau is the running
        mean of the prior (counted as one step) and the steps seen, until 1 / smoothing of them; from then on an
        exponential average with weight `smoothing`, so that it follows a workload that changes."""
        if verified:
            self._recorded += 1
            self.tau += self._weight(self._recorded + 1) * (1.0 + accepted / verified - self.tau)

    def breakeven_batch(self, limit: int) -> int | None:
        """The smallest batch size up to `limit` at which speculation stops paying (None: it pays up to it)."""
        return next((b for b in range(1, limit + 1) if not self.pays(b)), None)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() (after one warm-up call), synchronizing a CUDA device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d=None: None)
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def target_step_seconds(runner: ModelRunner, batch: int, query_len: int, context: int, repeats: int = 5) -> float:
    """Seconds of one target forward (its graphs where it has them) + LM head over `batch` requests of
    `query_len` new tokens each after `context` tokens: attention reads blocks 0.. of the cache, nothing is
    written (slots -1)."""
    bs = runner.block_size
    blocks = list(range(min(-(-(context + query_len) // bs), runner.num_blocks)))
    seq = min(context + query_len, len(blocks) * bs)
    q_lens, seq_lens = [query_len] * batch, [seq] * batch
    meta = attention_metadata(q_lens, seq_lens, [blocks] * batch, [-1] * (batch * query_len), runner.device)
    ids = torch.zeros(batch * query_len, dtype=torch.int64, device=runner.device)
    positions = torch.arange(seq - query_len, seq, device=runner.device).repeat(batch)

    def step() -> object:
        return runner.model.compute_logits(runner._forward(ids, positions, meta))

    return timed(step, runner.device, repeats)


def measure_step_costs(runner: ModelRunner, k: int, batch_sizes: Sequence[int], context: int,
                       draft_seconds: Callable[[int], float] | None = None) -> StepCosts:
    """StepCosts measured on the runner's device at each batch size (`draft_seconds(b)`: the proposer's
    cost of drafting k tokens for b requests; None: free)."""
    sizes = tuple(sorted(set(batch_sizes)))
    decode = tuple(target_step_seconds(runner, b, 1, context) for b in sizes)
    verify = tuple(target_step_seconds(runner, b, k + 1, context) for b in sizes)
    draft = tuple(draft_seconds(b) if draft_seconds is not None else 0.0 for b in sizes)
    return StepCosts(sizes, decode, verify, draft, k)
