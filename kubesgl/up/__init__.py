"""`kubesgl up -f FILE`: an InferenceService on this machine, its engines and router as local
processes started from the operator's own command lines (docs/up.md).

plan: the spec -> the processes; model: the model made or fetched once into a cache;
supervisor: starts, restarts and stops them; status: what the terminal shows; cli: the command.
"""
