"""The engine's half of a push: `PushReceiver` (one worker's side of the protocol) over
`WeightTarget`s, the worker extension our engine loads (`extension:WeightSyncExtension`), staging
memory and sources, and the calls that drive an engine's workers from the process holding the
engine (`engines`). Never imports the trainer's half (weight_sync.trainer)."""
