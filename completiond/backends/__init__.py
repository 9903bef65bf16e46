"""backends layer: where a completion is generated when it is not the local engine (a team server)."""
