"""The planning wing: measure -> plan, and the one writer of plan state (`planner.Planner`)."""
