"""The agent loop: tool-call parsers, token-exact chat rendering, and the multi-turn state machine."""
