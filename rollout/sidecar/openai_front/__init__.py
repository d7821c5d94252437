"""An OpenAI-compatible HTTP front on the sidecar (`python -m rollout.serve --http-port P`), for
agents that speak OpenAI's API: the same manager and engines as the ZMQ protocol, so pushes pause
HTTP requests as they pause ZMQ ones. Every response also carries the prompt's and completion's
token ids and each token's weight version, which a trainer needs to rebuild the exact sequence.
"""
