"""Generation engines behind one interface (`base.Engine`): `local` (transformers, in process)
and `sglang` (native `/generate` over HTTP)."""
