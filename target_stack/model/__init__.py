"""target_stack's model: layers with torch reference paths, quantisation (the engine is built on these)."""
