"""Self-calibration: learn, per replica, how far the cost model's TTFT estimates are off.

Each streamed request's observed time to first byte is compared with the estimate made when it
was routed; the correction is a moving geometric mean of observed / raw estimate, and it scales
every future estimate for that replica (routing/cost.py `correction`). Non-streamed responses
arrive whole, so their first byte includes the decode; only prefill-only ones (max_tokens <= 1,
such as prewarms) are used.
"""

from __future__ import annotations

import math

from gateway.metrics import Metrics
from gateway.registry import Replica

MIN_ESTIMATE_S = 0.005
# Below 5 ms the observation is dominated by the network round trip and the first decode step,
# which the cost model does not try to predict.

EWMA_WEIGHT = 0.05  # ~the last 20 observations: follows a slow GPU within seconds, not one outlier
CORRECTION_BOUNDS = (0.25, 4.0)  # a 4x miss means misconfiguration; do not chase it further


def observe(
    replica: Replica, raw_estimate_s: float, estimate_s: float, observed_s: float, metrics: Metrics
) -> None:
    if estimate_s > 0:
        metrics.estimate_ratio.labels(replica.name).observe(observed_s / estimate_s)
    if raw_estimate_s < MIN_ESTIMATE_S or observed_s <= 0:
        return
    low, high = CORRECTION_BOUNDS
    ratio = min(high, max(low, observed_s / raw_estimate_s))
    log_c = (1 - EWMA_WEIGHT) * math.log(replica.correction) + EWMA_WEIGHT * math.log(ratio)
    replica.correction = min(high, max(low, math.exp(log_c)))
    metrics.correction.labels(replica.name).set(replica.correction)
