"""`python -m recipes.real_model smollm2`: convert a real model's GGUF file into a cached HF
directory and print its path. The converter itself is `engine.models.real_models`, where the sidecar
(which must not depend on the recipes) finds it too."""

from engine.models.real_models import main

if __name__ == "__main__":
    main()
