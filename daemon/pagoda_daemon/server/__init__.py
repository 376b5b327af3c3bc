"""The serving daemon: an OpenAI-compatible API server process in front of an EngineCore process."""
