"""Training (DESIGN §7): the GRPO loss (``loss``), AdamW and its schedule (``optim``), a trainer replica
(``trainer``) laid over its workers by ``parallel`` (FSDP2 via ``sharding``, or whole), the replica
group and a joining replica's state transfer (``replicas``), colocated mode's offload (``offload``),
flat tensor buckets (``buckets``), the trainer → rollout weight sync (``weight_sync``) and checkpoints
(``checkpoint``). Import the modules themselves; this package imports nothing, so that importing it
stays cheap.
"""
