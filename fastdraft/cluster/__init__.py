"""Scale-out: rollout workers on Ray, their coordinator, the cluster simulator."""
