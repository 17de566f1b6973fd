"""The model: loading a Hugging Face folder (new-token rows included) and the LoRA/QLoRA
adapter axis."""
