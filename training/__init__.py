"""Training drafters for the model specserve serves (`specserve train-drafter`).

* `corpus`: chats to learn from (ShareGPT V3, or a user's JSONL), with a fixed held-out split.
* `regenerate`: the target answers every user turn itself, through specserve's engine.
* `features`: the target's hidden states at the layers a drafter reads, stored on disk.
* `eagle3`, `dflash`: the drafters' training-time forward passes and losses.
* `trainer`: the loop (checkpoints, resume, progress) and the checkpoint writers.
"""
