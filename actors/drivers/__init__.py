"""The drivers: the processes that compose the actors and run them (training, SFT, evaluation, serving,
a rehearsal, a chaos run), with the driver's own checkpoints and the watchdog it runs."""
