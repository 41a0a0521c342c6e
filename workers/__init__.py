"""Training jobs on Ray: `elastron worker-run JOB_ID` (workers.driver) runs a job spec as Ray
Train V2 runs, one actor per rank, with restarts from checkpoints, elastic resizes, the rerun
state machine's exit codes, a step watchdog, and telemetry to the control plane. See README.md
in this folder for the process model, the exit codes, the events and the telemetry wire format.

Importing this package imports neither Ray nor torch; the modules that need them import them.
"""
