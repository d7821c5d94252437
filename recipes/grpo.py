"""`python -m recipes.grpo`: GRPO on the rollout sidecar (see `--help`)."""

from recipes.rl_train import train


def main(argv: list[str] | None = None) -> dict:
    return train("grpo", argv)


if __name__ == "__main__":
    main()
