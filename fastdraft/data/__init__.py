"""Prompts, dataset files and their row checks, rewards, tasks."""
