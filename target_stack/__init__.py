"""target_stack: the small hybrid KDA / sparse-attention / MoE inference engine bundled with infra-agent.

``target_stack.ops`` holds the Triton kernels and their torch references; it picks Triton's
interpreter automatically on a machine without a GPU.
"""
