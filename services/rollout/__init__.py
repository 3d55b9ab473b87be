"""Rollout: inference engines (torch; sglang on GPU hosts), KV migration between them, and the
gateway (TITO gRPC, OpenAI / Anthropic / Responses HTTP) that records every call."""
