"""The estimate's oracle floor on a step engine: what an estimator that knows everything but
the future would miss by.

A request's TTFT on a vLLM V1 step loop depends on requests sent after it: one that arrives
before its last step forms shares that step and lengthens it, one whose KV is ready first is
scheduled while it still loads. No estimate made when the request is routed can know them. This
module replays each simulated replica's own requests (loadtest/sim/steps.py `replay`, the sims'
scheduler, with what each sim reported: its arrival, when its KV was loaded, the tokens it
computed) twice:

- **all of them**: the replica as it ran, every request decoding its tokens a step each. Its
  first-token times against the sims' own say how faithful the replay is;
- **up to the request itself**: the replica as it would have run had nothing arrived after it.
  Its time, plus the time the client saw outside the sim, is the estimate of an oracle that
  knows the present exactly (every constant, every cached block, every load time) and assumes
  no more arrivals: its error against the client's TTFT is the part of the estimate's error
  that knowing the present cannot remove.

Later arrivals only ever delay a request here (first come, first served, no preemption), so
the oracle under-estimates; `best_scaled_p90` gives the oracle the single factor that, in
hindsight, serves the p90 best: a floor for any estimator that scales a present-state estimate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.sim.steps import Arrival, StepSettings, replay
from routing.whatif.summary import percentile


@dataclass(frozen=True, slots=True)
class SimTimes:
    """What the sim reported of one request (its usage extension), in ms."""

    index: int  # the request's place in the trace
    replica: str
    arrived_at_ms: float  # time.monotonic(), one clock for every sim on the machine
    loaded_ms: float  # from its arrival: KV looked up and loaded (swap-in, fetch)
    first_token_ms: float  # from its arrival
    computed_tokens: int
    decode_steps: int = 0  # decode tokens after its first: steps it takes part in

    @classmethod
    def from_usage(cls, index: int, replica: str, sim: dict[str, float]) -> SimTimes | None:
        keys = ("arrived_at_ms", "loaded_ms", "first_token_ms", "computed_tokens")
        if not all(k in sim for k in keys):
            return None
        return cls(
            index,
            replica,
            sim["arrived_at_ms"],
            sim["loaded_ms"],
            sim["first_token_ms"],
            int(sim["computed_tokens"]),
            int(sim.get("decode_steps", 0)),
        )


@dataclass(frozen=True, slots=True)
class Replayed:
    sim_ms: float  # the sim's own first-token time, from the request's arrival
    replay_ms: float  # the replay of every request the replica had
    alone_ms: float  # the replay of the requests up to this one: nothing arrived after it


def replay_replicas(times: Sequence[SimTimes], settings: StepSettings) -> dict[int, Replayed]:
    """Each request's first-token time, from its arrival, as the sim saw it and as replayed with
    and without the requests that arrived after it on its replica. Requests the replay could
    not finish (none should) are left out."""
    by_replica: dict[str, list[SimTimes]] = defaultdict(list)
    for t in times:
        by_replica[t.replica].append(t)
    out: dict[int, Replayed] = {}
    for requests in by_replica.values():
        requests.sort(key=lambda t: t.arrived_at_ms)
        t0 = requests[0].arrived_at_ms
        arrivals = [
            Arrival(
                at_s=(t.arrived_at_ms - t0) / 1000,
                tokens=max(1, t.computed_tokens),  # vLLM computes the last token at least
                loaded_at_s=(t.arrived_at_ms - t0 + t.loaded_ms) / 1000,
                decode_steps=t.decode_steps,
            )
            for t in requests
        ]
        full = replay(settings, arrivals)
        for k, t in enumerate(requests):
            alone = replay(settings, arrivals[: k + 1])[k]
            everyone = full[k]
            if alone is None or everyone is None:
                continue
            at_s = arrivals[k].at_s
            out[t.index] = Replayed(
                t.first_token_ms, (everyone - at_s) * 1000, (alone - at_s) * 1000
            )
    return out


def oracle_errors(
    replayed: dict[int, Replayed], observed_ms: dict[int, float], scale: float = 1.0
) -> list[float]:
    """|oracle - observed| / observed per request in `observed_ms` (the client's TTFT): the
    oracle is the replay without later arrivals, times `scale`, plus the time the client saw
    outside the sim (observed - the sim's own first-token time)."""
    errors = []
    for index, obs_ms in observed_ms.items():
        r = replayed.get(index)
        if r is None or obs_ms <= 0:
            continue
        oracle_ms = scale * r.alone_ms + (obs_ms - r.sim_ms)
        errors.append(abs(oracle_ms - obs_ms) / obs_ms)
    return errors


def replay_errors(replayed: dict[int, Replayed], observed_ms: dict[int, float]) -> list[float]:
    """|replay of everyone - sim| / observed: how faithful the replay is, on the same scale."""
    return [
        abs(r.replay_ms - r.sim_ms) / obs_ms
        for index, obs_ms in observed_ms.items()
        if (r := replayed.get(index)) is not None and obs_ms > 0
    ]


def best_scaled_p90(
    replayed: dict[int, Replayed], observed_ms: dict[int, float]
) -> tuple[float, float]:
    """(scale, p90) for the factor on the oracle's time, 1.00 to 3.00 by 0.01, whose p90 error
    is lowest: chosen in hindsight on the very requests it is scored on, so a floor."""
    best = (1.0, percentile(oracle_errors(replayed, observed_ms), 90))
    for step in range(1, 201):
        scale = 1.0 + step / 100
        p90 = percentile(oracle_errors(replayed, observed_ms, scale), 90)
        if p90 < best[1]:
            best = (scale, p90)
    return best
