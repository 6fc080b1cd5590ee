"""What the launcher and its workers agree about stop signals."""

import signal

# What a job's processes are sent from outside: Ctrl-C at the terminal, a scheduler's SIGTERM,
# a hang-up, and the launcher's ask for a stack (SIGUSR2). The workers handle them; the fork
# server ignores them, and a worker it forks takes them back as an exec from the launcher
# would leave them (`launcher.worker.fork_server.Request.ignored`).
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)

# SLURM's preemption can deliver one SIGTERM twice (slurmstepd signals the task, and srun
# forwards its own): a second one within this many seconds is the same request to stop
# gracefully; only a later one means "now". The launcher and every worker count this way.
SIGTERM_REPEAT_WINDOW_S = 10.0
