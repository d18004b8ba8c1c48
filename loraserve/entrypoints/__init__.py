"""API server: OpenAI protocol, serving endpoints, the HTTP app."""
