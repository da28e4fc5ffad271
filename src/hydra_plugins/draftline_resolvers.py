"""Registers draftline's OmegaConf resolvers when Hydra scans `hydra_plugins` for plugins.

`dvc exp run -S ...` composes conf/ with Hydra inside DVC's process, which imports nothing of
draftline; Hydra's plugin scan (which DVC runs before composing) imports this module.
"""

from draftline.runtime.resolvers import register

register()
