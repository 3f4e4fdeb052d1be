"""The planner's terms, one module each: compute, communication, memory, pipeline and host, over
the shared vocabulary of ``common``; ``parabench.plan.model`` composes them."""
