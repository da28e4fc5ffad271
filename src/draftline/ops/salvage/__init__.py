"""Salvage: save everything before a node shuts down, and say plainly whether it is safe to
(`checklist.salvage` runs the steps; one module per concern)."""
