"""Raw conversations to curated prompt shards."""
