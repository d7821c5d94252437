"""SGLang's compatibility: the group a trainer written for SGLang's RL API forms
(`init_weights_update_group`), seen from our workers, and its wire (`update_weights_from_distributed`'s
per-tensor broadcasts or one flattened bucket) as our manifest. Served by rollout/sglang_transfer.py."""
