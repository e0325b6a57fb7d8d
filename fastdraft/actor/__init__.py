"""The policy's trainer: FSDP2 sharding, fp32 masters, loss scale, logprobs, micro-batches, its
memory plan, and the driver's face of its ranks (actor.py)."""
