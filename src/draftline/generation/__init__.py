"""Curated prompts to generated shards: the shard run, its journal and guard, the engines and
the SGLang server."""
