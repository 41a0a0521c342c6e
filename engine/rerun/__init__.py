"""Megatron-Core's rerun state machine, in three modules along its ideas: `state_machine.py`
decides (re-run a step whose result looks wrong, diagnose it, checkpoint or exit), `event_log.py`
records what happened on this rank, and `checkpoint_state.py` is what of the machine a checkpoint
keeps. The package sits below the checkpointer, which writes to the same event log and saves the
machine's state through its own protocol (engine/checkpointing/stateful.py)."""
