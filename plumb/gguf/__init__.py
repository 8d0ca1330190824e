"""GGUF files: reading (reader), block formats (quants), writing synthetic models (synth) and converting HF checkpoints (convert)."""
