"""Training recipes: the draft head (`engine draft`), the LoRA mask-denoising adapter (`engine adapt`), their data."""
