"""pleach server: the WebSocket sync server that reconciles a user's devices."""
