"""Distributed checkpointing: sharded state, resharding load, storage backends, commit protocol."""
