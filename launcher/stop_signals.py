"""What the launcher and its workers agree about stop signals."""

# SLURM's preemption can deliver one SIGTERM twice (slurmstepd signals the task, and srun
# forwards its own): a second one within this many seconds is the same request to stop
# gracefully; only a later one means "now". The launcher and every worker count this way.
SIGTERM_REPEAT_WINDOW_S = 10.0
