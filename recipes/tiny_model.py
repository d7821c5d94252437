"""`python -m recipes.tiny_model`: build a tiny offline model directory. The builder itself is
`engine.models.tiny_model`, where the sidecar (which must not depend on the recipes) finds it too."""

from engine.models.tiny_model import main

if __name__ == "__main__":
    main()
