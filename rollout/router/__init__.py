"""`python -m rollout.router`: session-affine, load-aware HTTP routing over several sidecars (issue 66):
rollout/router/app.py (routes), forward.py (a call and its failover), sidecars.py (who serves),
session_key.py (which session a call is), metrics.py; the placement is the client's
(rollout/client/placement.py)."""
