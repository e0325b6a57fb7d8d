"""Where the actor's ranks and the rollout replicas live: in this process (inline) or in hybrid
workers, one process per device holding that device's actor rank beside a full engine replica
(Ray actors, on any nodes)."""
