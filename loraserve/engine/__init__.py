"""Engine: protocol messages, core loop, scheduler, KV blocks, clients, offline LLM."""
