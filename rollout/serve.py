"""`python -m rollout.serve`: the rollout sidecar (its body: rollout/sidecar/main.py; its flags: `--help`)."""

from rollout.sidecar.main import main

if __name__ == "__main__":
    main()
