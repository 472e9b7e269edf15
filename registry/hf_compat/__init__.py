"""Hugging Face Hub-compatible read API: serving nodes pull artifacts with `huggingface_hub` / `HF_ENDPOINT`."""
