"""pleach client: an offline-first session runtime for LLM agents over a local SQLite file."""
