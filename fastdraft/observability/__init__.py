"""metrics.jsonl, wandb, the dashboard and the workers' timeline."""
