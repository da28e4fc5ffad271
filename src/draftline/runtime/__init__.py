"""How a run executes: params, hardware profiles, torch.distributed, atomic writes, run logs."""
