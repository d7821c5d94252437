"""The trainer's half of a push: `WeightSender` (rank 0 of the group), the push run once for
every caller (`push.run_push`), what a model sends (`weights`), a trainer of several ranks
(`ranks`), deltas, LoRA adapters, shared memory and push directories as the trainer writes them.
Runs in the trainer's process (and in a sidecar that catches a peer up)."""
