"""The router: OpenAI-compatible HTTP, gRPC Generation and Admin, over worker groups."""
