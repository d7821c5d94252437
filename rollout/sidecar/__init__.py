"""The sidecar's side (`python -m rollout.serve`): its start-up (main.py and the serve_* modules), the
ZMQ server, the rollout manager over its engines and their supervision, the push coordinator, the
HTTP fronts (openai_front/) and the foreign trainers' weight routes (vLLM's, SGLang's). Imports the
client (rollout.client) only where it is one: a sidecar sending its weights to a newcomer (peer_send.py)."""
