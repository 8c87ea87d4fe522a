"""Speculative decoding on the worker: proposers, drafters and verification.

* `speculators`: the one interface the model runner calls after each target step
  (`Speculator`), for every method.
* `ngram`: prompt-lookup proposals (no weights).
* `drafter`: what the hidden-state drafters share (KV cache, metadata, checkpoint tensors).
* `eagle3`: EAGLE-3 (one autoregressive decoder layer fed with fused target features).
* `dflash`: DFlash (a multi-layer block drafter; target features are injected as K/V).
* `rejection_sampler`: exact verification of drafts against the target's distribution.
"""
