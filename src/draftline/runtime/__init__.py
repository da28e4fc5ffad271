"""How a run executes: params, hardware profiles, torch.distributed, atomic writes, run logs,
the stage inputs DVC must have restored."""
