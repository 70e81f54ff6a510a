"""One runner per engine for `compress serve-check`: `decode(export_dir, prompts, n_tokens) -> Decoded`."""
