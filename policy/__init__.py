"""Pure distributed policies: no Ray and no device inside, each tested by hand on CPU.

- ``routing``: replica load balancers (colocated prefix affinity, PD prefill and decode balancers) and
  the data-parallel step vote.
- ``pd``: the prefill/decode disaggregation state machine of one request (events in, actions out).
- ``kv_store_index``: the KV store's block index (hash chain, LRU, TTL, byte limit).
- ``eplb``: DeepSeek's expert-parallel load-balancing algorithm; ``eplb_policy``: when to run it and
  over which window of expert load.

The Ray actors in ``rayinfer.actors`` are thin shells that carry these policies' decisions out.
"""
