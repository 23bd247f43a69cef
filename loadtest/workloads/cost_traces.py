"""A seeded multi-tenant trace for the cost accounting (loadtest/bench/costs.py, docs/costs.md).

Three tenants, one per way offloading's cost lands:

  agents  (standard)  questions about a few long shared documents, Zipf popularity: the prefixes
                      come back after HBM lost them, from the CPU tier (PCIe) or the remote tier
                      (network); the hits avoid most of the prefill
  bulk    (batch)     one-off long prompts: nothing comes back, so what the remote tier stores
                      for them is written and never read, and they push the documents out of HBM
  voice   (critical)  one short shared system prompt and a spoken sentence: small, HBM-resident,
                      its TTFT is the queue it meets

Records are loadtest.workloads.traces.TraceRecord (chat, streamed by the replayer). Sizes are in
tokens at routing.prompt.CHARS_PER_TOKEN characters per token.
"""

from __future__ import annotations

import random

from loadtest.workloads.traces import TraceRecord, words_text, zipf_weights

TENANT_CLASSES = {"agents": "standard", "bulk": "batch", "voice": "critical"}

AGENT_DOCS = 6
AGENT_DOC_TOKENS = (1_500, 2_500)
AGENT_QUESTION_TOKENS = (20, 60)
AGENT_ZIPF_S = 0.8  # popularity ~ 1 / rank^0.8, as loadtest/workloads/tier_traces.py's `high`
BULK_TOKENS = (1_500, 3_000)
VOICE_SYSTEM_TOKENS = 200
VOICE_USER_TOKENS = (10, 30)
MAX_TOKENS = 4  # a short answer: the accounting is about the prompt's KV
SHARES = {"agents": 0.5, "bulk": 0.3, "voice": 0.2}


def cost_trace(
    requests: int, rate_per_s: float, seed: int = 0, shares: dict[str, float] | None = None
) -> list[TraceRecord]:
    """`requests` Poisson arrivals at `rate_per_s`, each from a tenant drawn by `shares`."""
    rng = random.Random(seed)
    shares = shares or SHARES
    docs = [words_text(rng, rng.randint(*AGENT_DOC_TOKENS)) for _ in range(AGENT_DOCS)]
    weights = zipf_weights(AGENT_DOCS, AGENT_ZIPF_S)
    voice_system = words_text(rng, VOICE_SYSTEM_TOKENS)
    tenants, tenant_weights = list(shares), list(shares.values())
    out: list[TraceRecord] = []
    t_s = 0.0
    for _ in range(requests):
        t_s += rng.expovariate(rate_per_s)
        tenant = rng.choices(tenants, tenant_weights)[0]
        if tenant == "agents":
            doc = rng.choices(docs, weights)[0]
            question = words_text(rng, rng.randint(*AGENT_QUESTION_TOKENS))
            messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
        elif tenant == "bulk":
            messages = [{"role": "user", "content": words_text(rng, rng.randint(*BULK_TOKENS))}]
        else:
            utterance = words_text(rng, rng.randint(*VOICE_USER_TOKENS))
            messages = [
                {"role": "system", "content": voice_system},
                {"role": "user", "content": utterance},
            ]
        out.append(
            TraceRecord(
                t_s=round(t_s, 4),
                tenant=tenant,
                endpoint="chat",
                max_tokens=MAX_TOKENS,
                conversation=None,
                messages=messages,
            )
        )
    return out
