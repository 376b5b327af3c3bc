"""A serving benchmark for OpenAI-compatible endpoints (`pagoda bench serve|sweep`)."""
