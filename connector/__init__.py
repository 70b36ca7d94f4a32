"""Everything that runs beside vLLM or in the request path. Never imports disagg.operator."""
