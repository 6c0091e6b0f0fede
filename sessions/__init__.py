"""The session service (TITO turns over the session store plus an engine call) and its
OpenAI-compatible HTTP front; the rollout process serves them (rollout.http_front)."""
