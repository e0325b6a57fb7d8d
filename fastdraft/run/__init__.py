"""The run's composition root (run.py), the step loop (loop.py), every check before the first
step (preflight.py, inputs.py), stop and resume, the dry run."""
