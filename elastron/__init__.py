"""The `elastron` command: a thin dispatcher over the commands each layer owns."""
