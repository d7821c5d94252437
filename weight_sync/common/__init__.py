"""What both halves of a push stand on: the group and its store gates, the manifest, the votes,
digests and checksums, delta encoding, the LoRA arithmetic, push directories, devices and hosts.
Imports neither half (weight_sync.trainer, weight_sync.engine_side)."""
