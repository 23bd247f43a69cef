"""Engine integrations for precise mode: what the engines report about their KV cache, and the
token ids they see.

  events.py     the KV event types the index applies, engine hash -> gateway key (EngineBlockMap)
  source.py     EventSource: what one engine's integration provides (decode, replay)
  vllm.py       vLLM's EventSource: the ZMQ / msgpack wire codec and the replay request
  feed.py       one ZMQ subscriber per replica, the sequence check, applying events to the index
  tokenizer.py  the model's tokenizer and chat template (the engine's token ids for a request)
"""
