"""Executors run a stage graph. `local` runs it on this machine, in order."""
