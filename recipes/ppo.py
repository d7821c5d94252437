"""`python -m recipes.ppo`: PPO on the rollout sidecar (see `--help`)."""

from recipes.rl_train import train


def main(argv: list[str] | None = None) -> dict:
    return train("ppo", argv)


if __name__ == "__main__":
    main()
