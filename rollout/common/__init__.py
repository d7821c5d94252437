"""What the trainer's client and the sidecar both speak: the wire protocol's messages (protocol.py) and
the rollouts it carries (types.py). Imports neither side."""
